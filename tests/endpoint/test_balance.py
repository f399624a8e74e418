"""The data plane's decisions without a process: backend choice (balance), its wire rules (errors, key,
headers, affinity key, retries and holds), the saturation marks the controller sends (rotation), and the
capacity read from an engine's arguments."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from hpcserve.core.keys import read_key_file
from hpcserve.core.net import UNIX_PATH_MAX, unix_socket_path
from hpcserve.core.statuses import Routing
from hpcserve.endpoint.control.plane_client import dataplane_argv
from hpcserve.endpoint.control.rotation import Rotation, next_saturated, saturated_now
from hpcserve.endpoint.dataplane import wire
from hpcserve.endpoint.dataplane.routing import choose
from hpcserve.endpoint.dataplane.routing.least_loaded import least_loaded
from hpcserve.endpoint.dataplane.routing.prefix import within_share
from hpcserve.endpoint.dataplane.routing.prefix_index import (
    BLOCK_CHARS,
    DEFAULT_BLOCKS,
    MAX_BLOCKS_PER_BACKEND,
    TOKENS_PER_BLOCK,
    blocks_for,
    prompt_blocks,
    prompt_text,
)
from hpcserve.endpoint.dataplane.routing.table import Affinity, Backend, RoutingTable
from hpcserve.endpoint.protocol import BackendSpec, backends_from_json, in_flight_to
from hpcserve.engine.capacity import DEFAULT_MAX_NUM_SEQS, max_num_seqs
from hpcserve.engine.metrics import EngineLoad


def pool_of(*specs: BackendSpec) -> RoutingTable:
    pool = RoutingTable()
    pool.update(list(specs))
    return pool


def session(key: bytes) -> Affinity:
    return Affinity(session=key)


def send(pool: RoutingTable, policy: Routing, affinity: Affinity | None = None, now: float = 0.0) -> Backend:
    """A request that stays in flight."""
    backend = choose(pool, policy, affinity, now)
    backend.in_flight += 1
    return backend


# ---------------------------------------------------------------- choice

def test_least_loaded_follows_capacity():
    pool = pool_of(BackendSpec("http://big", 8), BackendSpec("http://small", 1))
    chosen = Counter(send(pool, Routing.LEAST_LOADED).url for _ in range(9))
    assert chosen == {"http://big": 8, "http://small": 1}


def test_an_idle_pool_is_used_in_turn():
    pool = pool_of(BackendSpec("http://a"), BackendSpec("http://b"))
    assert {choose(pool, Routing.LEAST_LOADED, None, 0.0).url for _ in range(4)} == {"http://a", "http://b"}
    assert [choose(pool, Routing.ROUND_ROBIN, None, 0.0).url for _ in range(4)] in (
        ["http://a", "http://b"] * 2, ["http://b", "http://a"] * 2)


def test_saturated_backends_are_skipped_while_another_has_room():
    pool = pool_of(BackendSpec("http://a", saturated=True), BackendSpec("http://b"))
    assert {send(pool, policy).url for policy in Routing for _ in range(5)} == {"http://b"}
    pool = pool_of(BackendSpec("http://a", saturated=True), BackendSpec("http://b", saturated=True))
    assert {choose(pool, Routing.LEAST_LOADED, None, 0.0).url for _ in range(4)} == {"http://a", "http://b"}


def test_a_full_backend_is_no_room_even_before_its_saturation_mark():
    # The het pool on the sandbox: the 8-slot replica marked saturated, the 1-slot one full but not yet
    # marked (the mark comes a metrics poll late). Taking "unmarked" for room sent it every request.
    for policy in (Routing.LEAST_LOADED, Routing.PREFIX):  # round robin takes each in turn, full or not
        pool = pool_of(BackendSpec("http://big", 8, saturated=True), BackendSpec("http://small", 1))
        chosen = Counter(send(pool, policy, session(b"same prompt")).url for _ in range(10))
        assert chosen["http://small"] <= 2 and chosen["http://big"] >= 8, (policy, chosen)


def test_failed_backends_are_skipped_until_their_pause_ends():
    pool = pool_of(BackendSpec("http://a"), BackendSpec("http://b"))
    pool.by_url["http://a"].failed_until = 10.0
    assert {choose(pool, Routing.ROUND_ROBIN, None, 5.0).url for _ in range(4)} == {"http://b"}
    pool.by_url["http://b"].failed_until = 8.0
    assert choose(pool, Routing.LEAST_LOADED, None, 5.0) is None  # none eligible: the caller holds
    assert pool.next_recovery(5.0) == 8.0
    assert choose(pool, Routing.LEAST_LOADED, None, 9.0).url == "http://b"


def test_a_retry_prefers_a_backend_it_has_not_tried():
    pool = pool_of(BackendSpec("http://a"), BackendSpec("http://b"))
    a = pool.by_url["http://a"]
    assert {choose(pool, Routing.LEAST_LOADED, None, 0.0, (a,)).url for _ in range(4)} == {"http://b"}
    assert choose(pool, Routing.LEAST_LOADED, None, 0.0, tuple(pool.active)) is not None  # all tried: any


def test_update_keeps_counters_and_retires_removed_backends_until_their_requests_end():
    pool = pool_of(BackendSpec("http://a"), BackendSpec("http://b"))
    a = send(pool, Routing.ROUND_ROBIN)
    assert pool.update([BackendSpec(url) for url in ("http://a", "http://b") if url != a.url]) is True
    assert pool.retired == {a.url: a} and a not in pool.active
    pool.release(a)
    assert pool.retired == {}
    assert pool.update([BackendSpec(b.url, 4) for b in pool.active]) is False  # settings only
    assert pool.active[0].capacity == 4
    with pytest.raises(ValueError, match="twice"):
        pool.update([BackendSpec("http://a"), BackendSpec("http://a")])


def test_prefix_keeps_a_key_on_one_backend_until_it_carries_more_than_its_share():
    pool = pool_of(*(BackendSpec(f"http://r{i}") for i in range(4)))
    first = choose(pool, Routing.PREFIX, session(b"session-1"), 0.0)
    assert all(choose(pool, Routing.PREFIX, session(b"session-1"), 0.0) is first for _ in range(20))
    homes = {choose(pool, Routing.PREFIX, session(f"session-{i}".encode()), 0.0).url for i in range(40)}
    assert len(homes) == 4  # keys spread over the ring
    # concurrent requests of one key: affinity while the preferred one stays within 1.25 x its share
    chosen = [send(pool, Routing.PREFIX, session(b"session-1")) for _ in range(8)]
    assert chosen[0] is first and len({b.url for b in chosen}) == 4
    assert max(b.in_flight for b in pool.active) <= 3  # ceil(1.25 x 8 / 4)


def test_prefix_moves_only_the_keys_of_a_removed_backend():
    pool = pool_of(*(BackendSpec(f"http://r{i}") for i in range(4)))
    keys = [f"k{i}".encode() for i in range(200)]
    before = {k: choose(pool, Routing.PREFIX, session(k), 0.0).url for k in keys}
    pool.update([BackendSpec(f"http://r{i}") for i in range(3)])
    after = {k: choose(pool, Routing.PREFIX, session(k), 0.0).url for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "http://r3")


def test_within_share_and_least_loaded_ties():
    a, b = Backend("http://a", 1), Backend("http://b", 1)
    assert within_share(a, [a, b])  # an idle pool keeps affinity
    a.in_flight = 2
    assert not within_share(a, [a, b])  # 3 of 3 on a: more than 1.25 x its half
    b.in_flight = 2
    assert least_loaded([a, b], 0) is a and least_loaded([a, b], 1) is b


def test_backend_spec_from_json_names_what_is_wrong():
    assert BackendSpec.from_json({"url": "http://h:1/", "capacity": 8}) == BackendSpec("http://h:1", 8, False)
    for bad, words in (({"url": "ftp://h"}, "not an http"), ({"url": "http://h", "capacity": 0}, "capacity"),
                       ({"url": "http://h", "capacity": True}, "capacity"), ("x", "object"),
                       ({"url": "http://h", "saturated": "yes"}, "saturated")):
        with pytest.raises(ValueError, match=words):
            BackendSpec.from_json(bad)


# ---------------------------------------------------------------- wire rules

def test_the_401_body_is_openai_json_that_says_where_the_key_is():
    error = json.loads(wire.UNAUTHORIZED)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    for words in ("hpcserve", "Authorization: Bearer", "api_key", "serve.api_key_env", "hpcserve status NAME"):
        assert words in error["message"]
    for body in (wire.no_backend(60), wire.too_large(2**20), wire.bad_request("x"), wire.bad_gateway("x")):
        assert set(json.loads(body)["error"]) == {"message", "type", "code"}
    raw = wire.too_many_connections(8)
    assert raw.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 5\r\n" in raw and raw.endswith(b"}}")


def test_headers_drop_hop_by_hop_ones_and_keep_the_rest():
    sent = wire.forwarded_headers([("Host", "x"), ("Authorization", "Bearer k"), ("Connection", "keep-alive"),
                                   ("Content-Length", "3"), ("Expect", "100-continue"), ("X-Request-Id", "r1"),
                                   ("Accept", "a"), ("Accept", "b")])
    assert sent == {"Authorization": "Bearer k", "X-Request-Id": "r1", "Accept": "a, b"}
    own = wire.forwarded_headers([("authorization", "Bearer user-key"), ("X-Request-Id", "r1")],
                                 {"Authorization": "Bearer deployment-key"})  # tenants: the user's key stays here
    assert own == {"X-Request-Id": "r1", "Authorization": "Bearer deployment-key"}
    assert wire.forwarded_headers([("Authorization", "Bearer user-key")], {}) == {}  # an endpoint without a key
    back = wire.returned_headers([("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked"),
                                  ("Server", "uvicorn"), ("x-request-id", "r1")])
    assert back == [("Content-Type", "text/event-stream"), ("x-request-id", "r1")]


def test_affinity_is_a_session_header_and_the_parsed_prompts_blocks():
    assert wire.request_affinity({"x-session-id": "s1"}, b"{}") == Affinity(b"s1", [])
    text = "w" * (3 * BLOCK_CHARS + 10)
    affinity = wire.request_affinity({}, json.dumps({"prompt": text}).encode())
    assert affinity.session is None and len(affinity.blocks) == 3  # whole blocks only
    assert wire.request_affinity({}, b'{"model": "m"}').blocks == [] and wire.request_affinity({}, None).blocks == []


def test_the_same_prompt_serialised_differently_has_the_same_blocks():
    # The review's finding: keyed on the raw bytes, spaces or escaped non-ASCII sent it elsewhere half the time.
    prompt = "Grüße aus Zürich, " * 40
    compact = json.dumps({"model": "m", "prompt": prompt}, separators=(",", ":"), ensure_ascii=False).encode()
    spaced = json.dumps({"prompt": prompt, "model": "m", "max_tokens": 3}, indent=2, ensure_ascii=True).encode()
    assert compact != spaced and prompt_blocks(prompt_text(compact)) == prompt_blocks(prompt_text(spaced))
    messages = [{"role": "user", "content": prompt}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
    assert prompt_text(json.dumps({"messages": messages}).encode()) == prompt_text(
        json.dumps({"messages": as_parts}, separators=(",", ":")).encode())


def test_a_long_shared_system_prompt_shares_only_its_own_blocks():
    system = {"role": "system", "content": "You are a careful assistant. " * 100}  # 2.9 KB
    one = prompt_blocks(prompt_text(json.dumps({"messages": [system, {"role": "user", "content": "a" * 600}]}).encode()))
    two = prompt_blocks(prompt_text(json.dumps({"messages": [system, {"role": "user", "content": "b" * 600}]}).encode()))
    shared = next(i for i, (x, y) in enumerate(zip(one, two)) if x != y)
    common = len("system\x1f") + len(system["content"]) + len("\x1fuser\x1f")  # what both texts begin with
    assert shared == common // BLOCK_CHARS  # every block wholly inside it, and not one more
    assert one[:shared] == two[:shared] and one[shared:] != two[shared:]


def prompt_of(prefix: int, suffix: int) -> Affinity:
    return Affinity(None, prompt_blocks(f"prefix-{prefix:04d} " * 200 + f"question {suffix}" * 8))


def test_repeats_of_a_prefix_follow_it_and_new_prefixes_spread():
    pool = pool_of(BackendSpec("http://a"), BackendSpec("http://b"))
    homes = {p: send(pool, Routing.PREFIX, prompt_of(p, 0)).url for p in range(20)}
    assert set(Counter(homes.values()).values()) == {10}  # new prefixes go where there is room
    for backend in pool.active:
        backend.in_flight = 0
    for suffix in range(1, 4):
        for p in range(20):
            assert send(pool, Routing.PREFIX, prompt_of(p, suffix)).url == homes[p], (p, suffix)


def test_a_holder_loaded_past_the_slack_gives_way_and_then_both_hold_it():
    pool = pool_of(BackendSpec("http://a", 16), BackendSpec("http://b", 16))
    first = send(pool, Routing.PREFIX, prompt_of(1, 0))
    chosen = [send(pool, Routing.PREFIX, prompt_of(1, i)) for i in range(1, 6)]
    # 0.25 x 16 = 4 requests of slack: the holder keeps the first ones, then the other takes over
    assert chosen[0] is first and chosen[1] is first and any(b is not first for b in chosen)
    for backend in pool.active:
        backend.in_flight = 0
    assert all(pool.index.match(b.url, prompt_of(1, 9).blocks) > 0 for b in pool.active)


def test_a_short_shared_start_does_not_pull_every_request_to_one_replica():
    pool = pool_of(BackendSpec("http://a"), BackendSpec("http://b"))
    start = "Answer briefly. " * 8  # two blocks, then long distinct questions
    chosen = Counter(send(pool, Routing.PREFIX, Affinity(None, prompt_blocks(start + f"{i:03d} " * 200))).url
                     for i in range(20))
    assert chosen["http://a"] == chosen["http://b"] == 10


def test_the_index_is_bounded_by_each_replicas_kv_cache_and_forgets_a_backend_that_left():
    pool = pool_of(BackendSpec("http://a", kv_tokens=TOKENS_PER_BLOCK * 100), BackendSpec("http://b"))
    for p in range(10):
        pool.index.record("http://a", prompt_of(p, 0).blocks)  # ~32 blocks each, 320 in all
    assert len(pool.index.held["http://a"]) == 100
    assert pool.index.match("http://a", prompt_of(9, 0).blocks) == len(prompt_of(9, 0).blocks)  # the newest kept
    assert pool.index.match("http://a", prompt_of(0, 0).blocks) == 0  # the oldest gone, first block first
    pool.update([BackendSpec("http://b")])
    assert "http://a" not in pool.index.held and "http://a" not in pool.index.limits
    assert blocks_for(None) == DEFAULT_BLOCKS and blocks_for(1 << 60) == MAX_BLOCKS_PER_BACKEND
    with pytest.raises(ValueError, match="kv_tokens"):
        BackendSpec.from_json({"url": "http://h", "kv_tokens": -1})
    assert BackendSpec.from_json({"url": "http://h", "kv_tokens": 64}).to_json()["kv_tokens"] == 64


def test_after_a_failure_connection_errors_are_retried_a_bounded_number_of_times():
    assert wire.after_failure(wire.Failure.CONNECT, 1, 3, 0) == wire.Attempt(retry=True, mark_failed=True)
    assert wire.after_failure(wire.Failure.CONNECT, 3, 3, 0).retry is False
    assert wire.after_failure(wire.Failure.TIMEOUT, 1, 3, 0) == wire.Attempt(retry=False, mark_failed=False)
    # a dropped connection: the engine may have had the request; sent again once at most (by default)
    assert wire.after_failure(wire.Failure.DISCONNECT, 1, 3, 0) == wire.Attempt(retry=True, mark_failed=False)
    assert wire.after_failure(wire.Failure.DISCONNECT, 2, 3, 1).retry is False
    assert wire.after_failure(wire.Failure.DISCONNECT, 1, 3, 0, max_resends=0).retry is False
    assert wire.after_failure(wire.Failure.CONNECT, 2, 3, 1).retry is True  # a refusal never reached one


def test_hold_waits_for_a_change_or_a_recovery_until_its_deadline():
    assert wire.hold_wait(0.0, 60.0, None) == 60.0
    assert wire.hold_wait(0.0, 60.0, 5.0) == 5.0  # a failed backend's pause ends first: look again then
    assert wire.hold_wait(0.0, 3.0, 5.0) == 3.0
    assert wire.hold_wait(60.0, 60.0, None) is None  # past the bound: 503


# ---------------------------------------------------------------- saturation marks (rotation)

def test_saturated_backends_are_marked_and_come_back_with_hysteresis():
    busy, idle, full = EngineLoad(4, 3, 0.5), EngineLoad(1, 0, 0.2), EngineLoad(2, 0, 0.97)
    assert saturated_now({"a": busy, "b": idle, "c": full}, set()) == {"a", "c"}
    assert saturated_now({"a": busy, "b": busy}, set()) == {"a", "b"}  # all: the data plane uses them all
    assert saturated_now({"a": EngineLoad(3, 0, 0.9), "b": idle}, {"a"}) == {"a"}  # KV not yet below 85 %
    assert saturated_now({"a": EngineLoad(3, 0, 0.5), "b": idle}, {"a"}) == set()
    assert saturated_now({"a": None, "b": idle}, {"a"}) == {"a"}  # no figures: left as it is
    busy_pool = next_saturated(["m0", "m1"], {"m1"}, {"m0": idle, "m1": busy}, {"m0"})
    assert busy_pool == {"m0", "m1"}  # m0's probe failed: its mark stays
    assert next_saturated(["m0"], {"m0"}, {"m0": idle}, {"m1"}) == set()  # m1 left the pool: forgotten


def test_a_request_waiting_in_an_engine_with_free_slots_is_not_saturation():
    # One waiting for the next scheduler step beside five running of eight slots: room; beside one of one: full.
    big, small = EngineLoad(5, 1, 0.3), EngineLoad(1, 1, 0.1)
    capacities = {"big": 8, "small": 1}
    assert saturated_now({"big": big, "small": small}, set(), capacities) == {"small"}
    assert saturated_now({"big": EngineLoad(8, 1, 0.3)}, set(), capacities) == {"big"}  # every slot taken
    assert saturated_now({"big": EngineLoad(2, 0, 0.97)}, set(), capacities) == {"big"}  # KV cache full
    assert saturated_now({"big": EngineLoad(2, 6, 0.97)}, set(), capacities) == {"big"}  # full: 2 run, 6 wait
    assert saturated_now({"x": big}, set(), capacities) == {"x"}  # capacity unknown: any queue counts


class RecordingRouter:
    def __init__(self):
        self.sent: list[set[str]] = []

    def capacities(self) -> dict[str, int]:
        return {}

    def set_saturated(self, urls) -> None:
        self.sent.append(set(urls))


def test_rotation_marks_instead_of_removing():
    router = RecordingRouter()
    rotation = Rotation(router)
    rotation.update(["a", "b"], {"a", "b"}, {"a": EngineLoad(2, 5, 0.5), "b": EngineLoad(1, 0, 0.2)})
    assert rotation.paused == {"a"} and router.sent == [{"a"}]


# ---------------------------------------------------------------- capacity, sockets, keys, admin JSON

def test_capacity_from_the_engine_arguments():
    assert max_num_seqs([]) == DEFAULT_MAX_NUM_SEQS == 256
    assert max_num_seqs(["--max-num-seqs", "8", "--dtype", "half"]) == 8
    assert max_num_seqs(["--max-num-seqs", "8", "--max-num-seqs=1"]) == 1  # the last one wins, as in vLLM
    assert max_num_seqs(["--max-num-seqs"]) == 256


def test_admin_socket_path_falls_back_when_the_run_folder_is_too_deep(tmp_path):
    short = tmp_path / "r" / "admin.sock"
    assert unix_socket_path(short) == short
    deep = tmp_path / ("d" * 120) / "admin.sock"
    fallback = unix_socket_path(deep, uid=1234)
    assert fallback == unix_socket_path(deep, uid=1234) and fallback.parent.name == "hpcserve-1234"
    assert len(str(fallback)) <= UNIX_PATH_MAX


def test_down_removes_a_fallback_admin_socket_and_its_folder_once_empty(tmp_path):
    from hpcserve.core.paths import RunPaths
    from hpcserve.endpoint.control.run import remove_admin_socket
    from hpcserve.endpoint.dataplane.server import bind_admin_socket

    paths = RunPaths(tmp_path / ("d" * 120))
    socket_path = paths.router_admin
    assert paths.root not in socket_path.parents
    bind_admin_socket(socket_path).close()
    remove_admin_socket(paths)
    assert not socket_path.exists()
    # the user's other deployments (tests beside this one) may still have sockets there
    assert not socket_path.parent.exists() or any(socket_path.parent.iterdir())


def test_key_file_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "key"
    path.write_text("k\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_key_file(path)
    path.chmod(0o600)
    assert read_key_file(path) == "k"


def test_admin_json_and_the_command_line(tmp_path):
    data = {"backends": [{"url": "http://h:1", "capacity": 8, "saturated": True, "in_flight": 2, "failed": False},
                         {"url": "http://h:2", "capacity": 1, "in_flight": 0, "failed": True}],
            "retired": [{"url": "http://h:3", "in_flight": 1}]}
    assert [(b.url, b.healthy, b.in_flight, b.capacity, b.saturated) for b in backends_from_json(data)] == [
        ("http://h:1", True, 2, 8, True), ("http://h:2", False, 0, 1, False)]
    assert in_flight_to(data, "http://h:3") == 1 and in_flight_to(data, "http://h:9") == 0
    key = tmp_path / "key"
    argv = dataplane_argv("127.0.0.1", 1, key, tmp_path / "s", Routing.PREFIX, 60)
    assert "--key-file" in argv and argv[argv.index("--policy") + 1] == "prefix"


def test_the_configured_routing_reaches_the_data_plane_and_a_wrong_one_is_named():
    from hpcserve.core.config import ConfigError, parse_config
    from hpcserve.endpoint.control.plane_client import dataplane_argv

    cfg = parse_config({"name": "r", "model": {"path": "builtin:tiny-llama"}, "serve": {"routing": "prefix"}})
    argv = dataplane_argv("127.0.0.1", 8000, None, Path("/tmp/a.sock"), cfg.serve.routing, cfg.serve.hold_s)
    assert argv[argv.index("--policy") + 1] == "prefix"
    assert parse_config({"name": "r", "model": {"path": "builtin:tiny-llama"}}).serve.routing is Routing.PREFIX
    with pytest.raises(ConfigError, match="serve.routing.*'least_loaded', 'round_robin' or 'prefix'"):
        parse_config({"name": "r", "model": {"path": "builtin:tiny-llama"}, "serve": {"routing": "sticky"}})


def test_the_routing_log_says_what_each_replica_held_and_where_the_request_went(tmp_path):
    from hpcserve.endpoint.dataplane.routing.log import RoutingLog

    pool, log = pool_of(BackendSpec("http://a"), BackendSpec("http://b")), RoutingLog(tmp_path / "routing.jsonl")
    first = log.choose(pool, Routing.PREFIX, prompt_of(7, 0), 0.0)
    repeat = log.choose(pool, Routing.PREFIX, prompt_of(7, 1), 0.0)
    assert log.choose(pool, Routing.PREFIX, None, 0.0) is not None  # nothing to route on: not written
    lines = [json.loads(line) for line in (tmp_path / "routing.jsonl").read_text().splitlines()]
    assert [line["to"] for line in lines] == [first.url, repeat.url] and repeat is first
    assert lines[0]["seen"] == {"http://a": [0.0, 0, 0.0], "http://b": [0.0, 0, 0.0]}
    held, in_flight, fill = lines[1]["seen"][first.url]
    assert held >= 0.5 and in_flight == 0 and fill > 0  # seen before the choice: the prefix sent there


def test_a_drained_backend_that_comes_back_is_no_longer_handed_over():
    """Handed over (its streams move away), then back in the pool before its last request ended: new
    streams there stay (before, they moved away at their first chunk)."""
    pool = pool_of(BackendSpec("http://a"), BackendSpec("http://b"))
    b = pool.by_url["http://b"]
    b.in_flight = 1  # a request still runs there: kept while it does
    pool.update([BackendSpec("http://a")])
    b.handing_over = True  # POST /handover
    pool.update([BackendSpec("http://a"), BackendSpec("http://b")])
    assert pool.by_url["http://b"] is b and b.in_flight == 1 and not b.handing_over
