"""Users behind the data plane (tenancy): their own keys, revocation on every worker, limits, the usage record
and per-project metrics. Real data-plane processes (two workers on one port) and a real SQLite store, in front
of a stand-in engine that demands the deployment's own key: a user's key must never reach it."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from helpers import free_port, stream_times
from prometheus_client.parser import text_string_to_metric_families
from router_fixtures import KEY, key_file, start_stubs, stop

from hpcserve.endpoint.control.plane_client import Router
from hpcserve.endpoint.dataplane.workers import worker_socket
from hpcserve.tenancy.keyring import add_key, revoke
from hpcserve.tenancy.records import Limits
from hpcserve.tenancy.settings import TenancySettings
from hpcserve.tenancy.store import GroupBy, open_store
from hpcserve.testing.harness import wait_until
from hpcserve.testing.postgres import create_database

FLUSH_S = 0.2


@contextmanager
def tenant_plane(directory: Path, database: str):
    """A stand-in engine behind a data plane of two workers whose tenancy store is `database`; yields the
    router, the store and the engine's URL; stops both after."""
    settings = directory / "tenancy.json"
    settings.write_text(json.dumps(TenancySettings(database, Limits(max_n=4), FLUSH_S).to_json()))
    (stub, url), = start_stubs(["a"], directory, token_delay_ms=0)
    router = Router("127.0.0.1", free_port(), key_file(directory), directory / "plane.log", model="stub",
                    admin_socket=directory / "plane" / "admin.sock", options=["--tenancy", str(settings)], workers=2)
    store = open_store(database)
    try:
        router.start([url])
        yield router, store, url
    finally:
        router.stop()
        router.close()
        store.close()
        stop(stub)


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tenants")
    with tenant_plane(directory, str(directory / "tenancy.sqlite")) as started:
        yield started


def post(router: Router, key: str, body: dict | None = None, client: httpx.Client | None = None) -> httpx.Response:
    """A completion on a connection of its own unless a client is given (the kernel picks a worker per
    connection)."""
    body = {"model": "stub", "prompt": "hello", "max_tokens": 2, **(body or {})}
    auth = {"Authorization": f"Bearer {key}"}
    if client is not None:
        return client.post(f"{router.url}/v1/completions", headers=auth, json=body)
    with httpx.Client(timeout=30, trust_env=False) as fresh:
        return fresh.post(f"{router.url}/v1/completions", headers={**auth, "Connection": "close"}, json=body)


def known(router: Router, key: str) -> None:
    """Wait until every worker knows a new key (each reloads within its poll)."""
    wait_until(lambda: all(post(router, key).status_code == 200 for _ in range(6)), 5, "the new key to be known")


def test_a_users_key_serves_and_the_engine_sees_only_the_deployments(plane):
    router, store, url = plane
    key, record = add_key(store, "alice", project="chem")
    known(router, key)  # the stand-in refuses any key but the deployment's: the user's was replaced
    assert post(router, KEY).status_code == 200  # the owner's key still serves
    wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    for bad in (wrong, f"hps_{'0' * 16}_whatever", "not-a-key"):
        answer = post(router, bad)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", bad


def test_a_revoked_key_is_refused_by_every_worker_within_a_second(plane):
    router, store, _ = plane
    key, record = add_key(store, "bob")
    known(router, key)
    before = refused_per_worker(router)
    revoke(store, record.key_id)
    time.sleep(1.0)  # the bound under test: revoked at t, refused everywhere from t + 1 s
    answers = [post(router, key).status_code for _ in range(20)]
    assert answers == [401] * 20
    after = refused_per_worker(router)
    assert all(a > b for a, b in zip(after, before)), (before, after)  # both workers refused it


def refused_per_worker(router: Router) -> list[int]:
    counts = []
    for index in range(2):
        transport = httpx.HTTPTransport(uds=str(worker_socket(router.admin_socket, index)))
        with httpx.Client(transport=transport, base_url="http://w", timeout=5) as client:
            counts.append(client.get("/stats").json()["stats"]["codes"].get("401", 0))
    return counts


def test_a_rate_refuses_with_the_limit_named_and_when_it_resets_on_every_worker(plane):
    router, store, _ = plane
    key, _ = add_key(store, "carol", limits=Limits(requests_per_minute=3))
    with httpx.Client(timeout=30, trust_env=False) as client:  # one connection: one worker counts them at once
        wait_until(lambda: post(router, key, client=client).status_code == 200, 5, "carol's key to be known")
        assert [post(router, key, client=client).status_code for _ in range(2)] == [200, 200]
        refused = post(router, key, client=client)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["param"] == "requests_per_minute" and error["code"] == "rate_limit_exceeded"
    assert "requests_per_minute = 3" in error["message"] and "resets" in error["message"]
    assert 1 <= int(refused.headers["Retry-After"]) <= 120
    # the other worker knows once the counts are written and read back (usage_flush_s + its poll)
    time.sleep(FLUSH_S + 1.0)
    assert [post(router, key).status_code for _ in range(10)] == [429] * 10


def test_caps_refuse_what_no_retry_makes_acceptable_and_fill_in_max_tokens(plane):
    router, store, url = plane
    key, _ = add_key(store, "dave", limits=Limits(max_tokens=5))
    known(router, key)
    # n above the deployment's cap (max_n = 4 for every key), max_tokens above the key's own
    for body, name in (({"n": 5}, "max_n"), ({"max_tokens": 6}, "max_tokens"), ({"n": 10000}, "max_n")):
        answer = post(router, key, body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == name, answer.text
        assert f"{name} = " in answer.json()["error"]["message"]
    # a request without max_tokens goes with the key's cap (else an engine generates to the context's end)
    assert post(router, key, {"max_tokens": None}).status_code == 200
    with httpx.Client(timeout=5, trust_env=False) as client:
        assert client.get(f"{url}/stub/stats").json()["last_body"]["max_tokens"] == 5


def test_a_key_for_some_models_is_refused_the_others(plane):
    router, store, _ = plane
    key, _ = add_key(store, "erin", models=("llama-70b",))
    wait_until(lambda: all(post(router, key).status_code == 403 for _ in range(6)), 5, "erin's key known to both")
    error = post(router, key).json()["error"]
    assert error["code"] == "model_not_allowed" and "llama-70b" in error["message"]
    # A body that names no model (or not as a string) gets the endpoint's own model: refused the same
    auth = {"Authorization": f"Bearer {key}"}
    for body in ({"prompt": "hello", "max_tokens": 2}, {"model": None, "prompt": "hello", "max_tokens": 2}):
        answer = httpx.post(f"{router.url}/v1/completions", headers=auth, json=body, timeout=30)
        assert answer.status_code == 403, answer.text
        assert "this endpoint's model 'stub' (the request names none)" in answer.json()["error"]["message"]


def test_every_request_has_its_usage_row_and_its_projects_counters(plane):
    router, store, _ = plane
    key, record = add_key(store, "frank", project="physics")
    known(router, key)
    since, counted = time.time(), project_tokens(router, "physics")
    answers = [post(router, key, {"prompt": f"usage {i}", "max_tokens": 3}) for i in range(5)]
    assert all(a.status_code == 200 for a in answers)
    wait_until(lambda: len([r for r in store.rows(since) if r.user == "frank"]) == 5, 10, "frank's five rows")
    rows = [r for r in store.rows(since) if r.user == "frank"]
    assert {(r.key_id, r.project, r.model, r.route, r.status, r.prompt_tokens, r.completion_tokens, r.migrated)
            for r in rows} == {(record.key_id, "physics", "stub", "/v1/completions", 200, 1, 3, False)}
    assert all(r.duration_s > 0 and r.ttft_s is not None and 0 < r.ttft_s <= r.duration_s for r in rows)
    totals = {t.group: t for t in store.usage(GroupBy.PROJECT, since)}
    assert totals["physics"].requests == 5 and totals["physics"].completion_tokens == 15
    assert project_tokens(router, "physics") == counted + 15  # /metrics, summed over both workers


def test_a_streams_usage_row_counts_the_token_ids_it_carried(plane):
    router, store, _ = plane
    key, _ = add_key(store, "heidi", project="bio")
    known(router, key)
    since = time.time()
    answers = [post(router, key, {"prompt": "stream me", "max_tokens": 4, "stream": True}) for _ in range(2)]
    assert all(a.status_code == 200 and '"token_ids":null' in a.text for a in answers)  # stripped for the client
    wait_until(lambda: len([r for r in store.rows(since) if r.user == "heidi"]) == 2, 10, "heidi's two rows")
    # the stand-in's prompt ids are its UTF-8 bytes; one id per token
    assert {(r.prompt_tokens, r.completion_tokens) for r in store.rows(since) if r.user == "heidi"} == {(9, 4)}


def project_tokens(router: Router, project: str) -> float:
    wanted = f'hpcserve_project_tokens_total{{kind="completion",project="{project}"}}'
    return sum(float(line.split()[-1]) for line in router.metrics().splitlines() if line.startswith(wanted))


def test_on_postgresql_keys_revocation_and_usage_work_alike(tmp_path, postgres_url):
    """The same data plane (two workers) with its store on a real PostgreSQL server, as a service on several
    hosts would run it: a user's key serves, its rows are written, its revocation reaches both workers."""
    with tenant_plane(tmp_path, create_database(postgres_url, "plane_test")) as (router, store, _):
        key, record = add_key(store, "grace", project="astro")
        known(router, key)
        since = time.time()
        assert all(post(router, key, {"prompt": f"pg {i}"}).status_code == 200 for i in range(4))
        wait_until(lambda: len([r for r in store.rows(since) if r.user == "grace"]) == 4, 10, "grace's rows")
        assert {(r.project, r.completion_tokens, r.status) for r in store.rows(since)} == {("astro", 2, 200)}
        revoke(store, record.key_id)
        time.sleep(1.0)
        assert [post(router, key).status_code for _ in range(10)] == [401] * 10


def test_fair_share_holds_a_lone_users_excess_and_starts_a_newcomer_in_a_free_place(tmp_path):
    """Two stand-ins that run 2 requests each and queue the rest (--max-num-seqs 2), 0.5 s a request. A
    user alone gets the pool's places (2 + 1 per engine): the excess waits in the data plane, where the
    controller counts it. A second user's request then starts at once, long before the first user's queue
    drains: three of the first user's streams pause (two places for the requests queued in the engines, one
    for the newcomer) and continue later."""
    settings = tmp_path / "tenancy.json"
    database = str(tmp_path / "tenancy.sqlite")
    settings.write_text(json.dumps(TenancySettings(database, Limits(), FLUSH_S).to_json()))
    stubs = start_stubs(["a", "b"], tmp_path, token_delay_ms=50, slots=[2, 2])
    router = Router("127.0.0.1", free_port(), key_file(tmp_path), tmp_path / "plane.log", model="stub",
                    admin_socket=tmp_path / "plane" / "admin.sock", options=["--tenancy", str(settings)])
    store = open_store(database)
    heavy_key, _ = add_key(store, "heavy", project="batch")
    light_key, _ = add_key(store, "light", project="chat")
    body = {"model": "stub", "prompt": "hello", "max_tokens": 10, "stream": True}

    def times(client: httpx.Client, key: str) -> tuple[float, float, float]:
        """When a streamed request was sent, when its first byte came, when it ended (time.monotonic)."""
        started = time.monotonic()
        with client.stream("POST", f"{router.url}/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as response:
            assert response.status_code == 200
            first = None
            for _ in response.iter_bytes():
                first = time.monotonic() if first is None else first
        ended = time.monotonic()
        return started, first or ended, ended

    def streams_open() -> float:
        return next(family.samples[0].value for family in text_string_to_metric_families(router.metrics())
                    if family.name == "hpcserve_router_streams_open")

    try:
        router.start([])
        for _, url in stubs:
            router.add(url, capacity=2)
        with (httpx.Client(timeout=30, trust_env=False, limits=httpx.Limits(max_connections=40)) as client,
              ThreadPoolExecutor(17) as pool):
            heavy = [pool.submit(times, client, heavy_key) for _ in range(16)]
            wait_until(lambda: router.backends_json()["waiting"] == 10, 5, "the lone user's excess to wait")
            assert sum(b["in_flight"] for b in router.backends_json()["backends"]) == 6  # 2 + 1 per engine
            wait_until(lambda: streams_open() == 4, 5, "the running batches' streams to begin")
            _, light_first, _ = pool.submit(times, client, light_key).result()
            heavy_times = [f.result() for f in heavy]
            # at once: before any of the heavy user's requests ended (the first batch's end, 0.5 s in)
            assert light_first < min(ended for _, _, ended in heavy_times)
            assert max(first - started for started, first, _ in heavy_times) > 1.5  # the heavy queue did wait
        # /metrics tells who waited in the data plane: the heavy user's excess and its three paused streams,
        # the light user's one request (for as long as the pauses took)
        families = {family.name: family for family in text_string_to_metric_families(router.metrics())}
        counts = {sample.labels["project"]: sample.value
                  for sample in families["hpcserve_project_admission_wait_seconds"].samples
                  if sample.name.endswith("_count")}
        assert counts == {"batch": 13, "chat": 1}
        assert families["hpcserve_router_stream_pauses"].samples[0].value == 3
    finally:
        router.stop()
        router.close()
        store.close()
        for proc, _ in stubs:
            stop(proc)


def test_a_heavy_users_stream_pauses_for_a_light_user_and_then_continues_whole(tmp_path):
    """One stand-in of 2 places (--max-num-seqs 2), 50 ms a token. The heavy user's two long streams take both
    places, so the light user's request would wait for one of them to end (2 s). One of the heavy streams
    pauses instead: the light request starts at once, and the paused stream continues when a place frees.
    Its client gets every token once, in one stream, and its usage row counts each token once."""
    settings = tmp_path / "tenancy.json"
    database = str(tmp_path / "tenancy.sqlite")
    settings.write_text(json.dumps(TenancySettings(database, Limits(), FLUSH_S).to_json()))
    (stub, url), = start_stubs(["a"], tmp_path, token_delay_ms=50, slots=[2])
    router = Router("127.0.0.1", free_port(), key_file(tmp_path), tmp_path / "plane.log", model="stub",
                    admin_socket=tmp_path / "plane" / "admin.sock", options=["--tenancy", str(settings)])
    store = open_store(database)
    heavy_key, _ = add_key(store, "heavy", project="batch")
    light_key, _ = add_key(store, "light", project="chat")

    def stream(key: str, tokens: int, under_way: threading.Event | None = None) -> tuple[float, str, dict]:
        """(seconds to the first event, the text, the usage) of one streamed completion."""
        body = {"model": "stub", "prompt": "hello", "max_tokens": tokens, "stream_options": {"include_usage": True}}
        times, lines = stream_times(router.url, body, key, 30, under_way)
        events = [json.loads(line[len("data:"):]) for line in lines if line != "data: [DONE]"]
        text = "".join(choice.get("text") or "" for event in events for choice in event["choices"])
        return times[0], text, next((event["usage"] for event in events if event.get("usage")), {})

    try:
        router.start([])
        router.add(url, capacity=2)
        since = time.time()
        with ThreadPoolExecutor(3) as pool:
            under_way = [threading.Event(), threading.Event()]
            heavy = [pool.submit(stream, heavy_key, 40, event) for event in under_way]
            assert all(event.wait(10) for event in under_way), "the heavy user's streams to begin"
            light_first, light_text, _ = pool.submit(stream, light_key, 4).result()
            assert light_first < 0.5, light_first  # at once, not after a heavy stream's end (2 s)
            for answer in heavy:
                _, text, usage = answer.result()
                assert text == "x" * 40 and usage["completion_tokens"] == 40, (text, usage)
        assert light_text == "xxxx"
        assert [(family.name, family.samples[0].value) for family in text_string_to_metric_families(router.metrics())
                if family.name == "hpcserve_router_stream_pauses"] == [("hpcserve_router_stream_pauses", 1.0)]
        wait_until(lambda: len(store.rows(since)) == 3, 10, "the three usage rows")
        assert sorted((r.user, r.completion_tokens, r.migrated) for r in store.rows(since)) == [
            ("heavy", 40, False), ("heavy", 40, False), ("light", 4, False)]
    finally:
        router.stop()
        router.close()
        store.close()
        stop(stub)
