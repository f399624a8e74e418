"""What the data plane does when a client or an engine misbehaves, as real processes in front of stand-in
engines (hpcserve.testing.standin): a client that leaves before the first chunk, a request that kills its
engine, an engine that never answers or falls silent mid-stream, answers too big to hold, keys sent in
another case, and one prompt serialised two ways. Each was a finding of the data plane's review."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from helpers import free_port
from router_fixtures import KEY, headers, key_file, start_stubs, stop, stub_stats, wait_for

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.control.plane_client import Router, RouterError

HTTP = httpx.Client(timeout=30, trust_env=False)
FIRST_TOKEN_S = 3.0
END_DELAY_S = 0.3


def start_router(directory, name: str, urls: list[str], options: list[str] = ()) -> Router:
    router = Router("127.0.0.1", free_port(), key_file(directory), directory / f"{name}.log", model="stub",
                    admin_socket=directory / name / "admin.sock", policy=Routing.PREFIX, options=options)
    router.start(urls)
    return router


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """Two stand-ins whose streams send headers at once and their first chunk 3 s later (as vLLM does
    behind a long queue), and three quick ones; the data planes start in each test's fixture."""
    directory = tmp_path_factory.mktemp("dataplane-failures")
    slow = start_stubs(["s1", "s2"], directory, token_delay_ms=20,
                       extra=["--first-token-delay-ms", str(FIRST_TOKEN_S * 1000)])
    quick = start_stubs(["a", "b", "c"], directory, token_delay_ms=0)
    late_end = start_stubs(["e"], directory, token_delay_ms=0, extra=["--end-delay-ms", str(END_DELAY_S * 1000)])
    yield directory, [url for _, url in slow], [url for _, url in quick], [url for _, url in late_end]
    for proc, _ in slow + quick + late_end:
        stop(proc)


@pytest.fixture(scope="module")
def slow_start(stand_ins):
    """Data planes in front of the slow stand-ins: defaults, and a 1.5 s first-byte timeout."""
    directory, urls, _, _ = stand_ins
    routers = {}
    try:
        for name, options in (("plain", []), ("impatient", ["--first-byte-timeout-s", "1.5"])):
            routers[name] = start_router(directory, name, urls, options)
        yield routers, urls
    finally:
        for router in routers.values():
            router.stop()
            router.close()


@pytest.fixture(scope="module")
def quick(stand_ins):
    directory, _, urls, _ = stand_ins
    router = start_router(directory, "quick", urls)
    yield router, urls
    router.stop()
    router.close()


def in_flight(urls) -> int:
    return sum(stub_stats(url)["in_flight"] for url in urls)


def test_a_client_that_leaves_before_the_first_chunk_stops_the_engine(slow_start):
    routers, urls = slow_start
    router = routers["plain"]
    body = json.dumps({"model": "stub", "prompt": "leave early", "max_tokens": 100, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                       + b"\r\n\r\n" + body)
        wait_for(lambda: in_flight(urls) == 1, 2.0)  # the engine has it; nothing has come back yet
        client.setblocking(False)
        with pytest.raises(BlockingIOError):
            client.recv(1)
    left = time.monotonic()
    # The data plane closes its connection to the engine at once (the stand-in, like vLLM, aborts then):
    # before the fix the engine ran to its end (3 s + 100 x 20 ms) with the data plane counting nothing.
    wait_for(lambda: in_flight(urls) == 0, 1.0)
    assert time.monotonic() - left < FIRST_TOKEN_S - 1.0
    wait_for(lambda: all(b.in_flight == 0 for b in router.backends()), 1.0)


def test_a_request_that_kills_its_engine_reaches_two_engines_at_most(quick):
    router, urls = quick
    before = sum(stub_stats(url)["crashed"] for url in urls)
    answer = HTTP.post(f"{router.url}/v1/completions", headers=headers(),
                       json={"model": "stub", "prompt": "__crash__", "max_tokens": 2})
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "replica_unreachable"
    # it reached an engine that then dropped the connection: sent again once (a replica killed under a
    # request costs none), not to every replica (it was tried on three before)
    assert sum(stub_stats(url)["crashed"] for url in urls) - before == 2
    assert 'hpcserve_router_resends_total 1.0' in router.metrics()


def test_the_wait_for_the_first_byte_has_its_own_bound(slow_start):
    routers, urls = slow_start
    started = time.monotonic()
    answer = HTTP.post(f"{routers['impatient'].url}/v1/completions", headers=headers(),
                       json={"model": "stub", "prompt": "slow", "max_tokens": 2, "stream": True})
    assert answer.status_code == 504 and answer.json()["error"]["code"] == "replica_timeout"
    assert 1.4 < time.monotonic() - started < FIRST_TOKEN_S  # not tried elsewhere, not waited out
    assert "1.5 s" in answer.json()["error"]["message"]
    wait_for(lambda: in_flight(urls) == 0, 1.0)  # the engine's request was closed with it


def test_an_answer_larger_than_the_buffer_streams_through_and_bad_flags_are_named(stand_ins, tmp_path):
    directory, _, urls, _ = stand_ins
    router = start_router(directory, "small-buffer", urls, ["--max-buffer-mb", "0.001"])
    try:
        small = HTTP.post(f"{router.url}/v1/completions", headers=headers(),
                          json={"model": "stub", "prompt": "small", "max_tokens": 3})
        assert small.headers["content-length"] == str(len(small.content))  # read whole, passed whole
        # ~5 KB with its length: above the 1 KB buffer it is passed on as it arrives, never held whole
        big = HTTP.post(f"{router.url}/v1/completions", headers=headers(),
                        json={"model": "stub", "prompt": "big", "max_tokens": 5000})
        assert big.status_code == 200 and len(big.json()["choices"][0]["text"]) == 5000
        assert "content-length" not in big.headers and big.headers["transfer-encoding"] == "chunked"
    finally:
        router.stop()
        router.close()
    for bad in (["--first-byte-timeout-s", "0"], ["--resends", "-1"], ["--workers", "0"]):
        refused = Router("127.0.0.1", free_port(), None, tmp_path / "bad.log", admin_socket=tmp_path / "a" / "s",
                         options=bad)
        with pytest.raises(RouterError, match="exited with code 2"):
            refused.start([])
        refused.close()
        assert "must be" in (tmp_path / "bad.log").read_text()


def test_the_key_scheme_in_any_case_is_accepted_and_a_longer_key_refused(quick):
    router, _ = quick
    for scheme in ("bearer", "BEARER"):
        ok = HTTP.get(f"{router.url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert ok.status_code == 200, scheme
    assert HTTP.get(f"{router.url}/v1/models", headers={"Authorization": f"Bearer {KEY}x"}).status_code == 401


def test_one_prompt_serialised_two_ways_meets_the_same_replica(quick):
    router, _ = quick
    prompt = "Grüße, ünïcode and a shared start. " * 30

    def served_by(raw: bytes) -> str:
        answer = HTTP.post(f"{router.url}/v1/completions", content=raw,
                           headers={**headers(), "Content-Type": "application/json"})
        assert answer.status_code == 200
        return answer.headers["x-backend"]

    for i in range(6):  # before the fix, a raw-bytes key split these about half and half
        text = f"{prompt} variant {i}"
        compact = json.dumps({"model": "stub", "prompt": text, "max_tokens": 1}, separators=(",", ":"),
                             ensure_ascii=False).encode()
        spaced = json.dumps({"max_tokens": 1, "prompt": text, "model": "stub"}, indent=1).encode()
        assert served_by(compact) == served_by(spaced)


def _requests_by_code(router: Router) -> dict[str, float]:
    counts = {}
    for line in router.metrics().splitlines():
        if line.startswith("hpcserve_router_requests_total{"):
            counts[line.split('code="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return counts


@pytest.mark.parametrize("migrations", ["2", "0"])
def test_a_client_that_hangs_up_once_it_has_the_whole_stream_is_counted_as_answered(stand_ins, migrations):
    """Most clients (the OpenAI client, vllm bench) stop reading at `data: [DONE]` and close the connection
    before the body's last (empty) chunk, which vLLM's server sends a little later under load: they got the
    whole answer, which is no 499 (a client that left). Streams that may migrate and those that may not."""
    directory, _, _, urls = stand_ins
    router = start_router(directory, f"late-end-{migrations}", urls, ["--migrations", migrations])
    try:
        body = json.dumps({"model": "stub", "prompt": "hang up at the end", "max_tokens": 5, "stream": True}).encode()
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", router.port), timeout=10) as client:
                client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: "
                               + str(len(body)).encode() + b"\r\n\r\n" + body)
                received = b""
                while b"[DONE]" not in received:
                    piece = client.recv(65536)
                    assert piece, received[-300:]
                    received += piece
        wait_for(lambda: sum(_requests_by_code(router).values()) == 3, 5 * END_DELAY_S + 2)
        assert _requests_by_code(router) == {"200": 3}
    finally:
        router.stop()
        router.close()
