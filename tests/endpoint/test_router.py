"""The endpoint's data plane (endpoint/dataplane/, driven by control/plane_client.Router) as real processes
in front of real backend processes: the fast OpenAI stand-in (hpcserve.testing.standin). The same behaviour
in front of real vLLM engines: test_router_vllm.py. The pure decisions: test_balance.py.
Every process here is started and stopped by its PID. Processes are shared where tests only read."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from helpers import free_port
from router_fixtures import (
    KEY,
    headers,
    key_file,
    run_load,
    start_stubs,
    stop,
    stream_times,
    stub_stats,
    wait_for,
)

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.control.plane_client import Router, RouterError, stop_router

STRICT = ["--max-body-mb", "1", "--header-timeout-s", "1", "--body-timeout-s", "1", "--max-connections", "6"]
HTTP = httpx.Client(timeout=30, trust_env=False)  # one keep-alive client: a new one per request costs ~50 ms


@pytest.fixture(scope="module")
def all_stubs(tmp_path_factory):
    """a and b serve every test; c (slow) and d come and go in the drain and kill tests."""
    directory = tmp_path_factory.mktemp("router")
    started = start_stubs(["a", "b", "c", "d"], directory, token_delay_ms=20)
    yield started, directory
    for proc, _ in started:
        stop(proc)


@pytest.fixture(scope="module")
def stubs(all_stubs):
    started, directory = all_stubs
    return dict(started[:2]), directory  # proc -> url


def make_router(directory, name: str, **kwargs) -> Router:
    key = kwargs.pop("key") if "key" in kwargs else key_file(directory)
    return Router("127.0.0.1", free_port(), key, directory / f"{name}.log",
                  model="stub", admin_socket=directory / name / "admin.sock", **kwargs)


@pytest.fixture(scope="module")
def pool(stubs):
    backends, directory = stubs
    router = make_router(directory, "main")
    try:
        router.start(list(backends.values()))
        yield router, backends, directory
    finally:
        router.stop()
        router.close()


@pytest.fixture(scope="module")
def strict(stubs):
    """A data plane with tight limits and a short hold, started with no backend."""
    _, directory = stubs
    router = make_router(directory, "strict", hold_s=1.5, options=STRICT)
    try:
        router.start([])
        yield router
    finally:
        router.stop()
        router.close()


def _complete(router: Router, key: str | None = KEY, **body) -> httpx.Response:
    body = {"model": "stub", "prompt": "Hello", "max_tokens": 4, **body}
    return HTTP.post(f"{router.url}/v1/completions", json=body, headers=headers(key) if key else {})


def _served(urls) -> int:
    return sum(stub_stats(url)["requests"] for url in urls)


# ---------------------------------------------------------------- the client port

def test_key_enforced_at_the_router_with_an_openai_json_401(pool):
    router, stubs, _ = pool
    before = _served(stubs.values())
    for key in (None, "wrong"):
        refused = _complete(router, key=key)
        assert refused.status_code == 401 and refused.headers["content-type"].startswith("application/json")
        error = refused.json()["error"]
        assert error["code"] == "invalid_api_key" and "hpcserve status NAME" in error["message"]
    models = HTTP.get(f"{router.url}/v1/models")
    assert models.status_code == 401  # every route, not only completions
    assert _served(stubs.values()) == before  # refused by the data plane itself: no backend saw them
    assert _complete(router).status_code == 200
    assert router.probe() == "xxxxxxxx"  # a real completion through the router (the stub's 8 tokens)
    chat = HTTP.post(f"{router.url}/v1/chat/completions", headers=headers(),
                      json={"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == "xxx"
    models = HTTP.get(f"{router.url}/v1/models", headers=headers())
    # answered by the data plane from its models (docs/endpoint.md, Many models behind one URL): no backend
    assert [(m["id"], m["state"]) for m in models.json()["data"]] == [("stub", "serving")]
    assert "x-backend" not in models.headers
    health = HTTP.get(f"{router.url}/health")  # open: says only that the data plane lives
    assert health.status_code == 200 and health.content == b""


def test_admin_routes_are_not_on_the_client_port_and_its_socket_is_owner_only(pool):
    router, _, _ = pool
    for method, path in (("GET", "/backends"), ("PUT", "/backends"), ("GET", "/metrics")):
        assert HTTP.request(method, f"{router.url}{path}", json={"backends": []}).status_code == 401
    for method in ("GET", "PUT"):
        with_key = HTTP.request(method, f"{router.url}/backends", json={"backends": []}, headers=headers())
        assert with_key.status_code == 404 and with_key.headers.get("x-backend")  # the engine's 404: no admin here
    engine_metrics = HTTP.get(f"{router.url}/metrics", headers=headers()).text
    assert "vllm:num_requests_running" in engine_metrics and "hpcserve_router" not in engine_metrics
    assert len(router.backends()) == 2  # the PUTs above changed nothing
    mode = os.stat(router.admin_socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(os.stat(router.admin_socket.parent).st_mode) == 0o700
    metrics = router.metrics()
    assert 'hpcserve_router_requests_total{code="200"}' in metrics and "hpcserve_router_backend_in_flight" in metrics


def test_client_and_engine_errors_do_not_take_backends_out(pool):
    router, stubs, _ = pool
    for _ in range(8):  # more than any breaker's threshold, on every backend
        assert _complete(router, prompt="__answer_400__").status_code == 400
    failed = sum(stub_stats(url)["failed"] for url in stubs.values())
    # one request answered 500 by each backend (in turn on an idle pool), passed through
    assert [_complete(router, prompt="__answer_500__").status_code for _ in range(2)] == [500, 500]
    assert sum(stub_stats(url)["failed"] for url in stubs.values()) == failed + 2
    assert all(stub_stats(url)["failed"] > 0 for url in stubs.values())
    assert all(_complete(router).status_code == 200 for _ in range(4))  # the next requests: served at once
    assert all(b.healthy for b in router.backends())


def test_streaming_passes_through_incrementally(pool):
    router, _, _ = pool
    times, lines = stream_times(router.url, {"model": "stub", "prompt": "Hi", "max_tokens": 20})
    assert lines[-1] == "data: [DONE]" and len(lines) == 21
    # the stub sends one token per 20 ms: chunks must arrive spread over ~400 ms, not all at the end
    assert times[-1] - times[0] > 0.3 and times[1] < times[-1] / 2


def test_a_client_that_leaves_mid_stream_frees_the_engine(pool):
    router, stubs, _ = pool
    body = {"model": "stub", "prompt": "long", "max_tokens": 200, "stream": True}  # 4 s at 20 ms a token
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=headers(), timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data:")
    # the client is gone: the data plane closes its connection to the engine, which stops generating
    wait_for(lambda: sum(stub_stats(url)["in_flight"] for url in stubs.values()) == 0, 2.0)
    wait_for(lambda: all(b.in_flight == 0 for b in router.backends()), 2.0)


def test_requests_spread_over_both_backends(pool):
    router, _, _ = pool
    stop_event = threading.Event()
    threads, result = run_load(router.url, "stub", stop_event, workers=4)
    time.sleep(1.5)
    stop_event.set()
    for thread in threads:
        thread.join(30)
    assert not result.failed and set(result.served_by) == {"a", "b"}
    assert min(result.served_by.values()) > 0.25 * result.ok


def test_removed_backend_drains_and_gets_nothing_new(pool, all_stubs):
    router, stubs, _ = pool
    url = all_stubs[0][2][1]  # c
    router.add(url)
    for other in stubs.values():
        router.remove(other, drain_s=5)
    got: dict = {}
    reader = threading.Thread(target=lambda: got.update(zip(("times", "lines"), stream_times(
        router.url, {"model": "stub", "prompt": "drain me", "max_tokens": 200}))))
    reader.start()  # a long stream on c (4 s: the adds below took over 1 s in a loaded CI run), the only backend now
    wait_for(lambda: stub_stats(url)["in_flight"] == 1)
    for other in stubs.values():
        router.add(other)
    assert stub_stats(url)["in_flight"] == 1  # still streaming when removed
    assert router.remove(url, drain_s=30) is True
    # it waited for the stream (200 x 20 ms): nothing runs on c once remove returned
    assert stub_stats(url)["in_flight"] == 0
    served_before = stub_stats(url)["requests"]
    for _ in range(6):
        assert _complete(router).status_code == 200
    assert stub_stats(url)["requests"] == served_before  # nothing new on c
    reader.join(30)
    assert got["lines"][-1] == "data: [DONE]" and len(got["lines"]) == 201  # the stream finished whole


def test_killed_backend_costs_no_request_and_new_backend_gets_traffic(pool, all_stubs):
    router, _, _ = pool
    proc, url = all_stubs[0][3]  # d
    router.add(url)
    stop_event = threading.Event()
    threads, result = run_load(router.url, "stub", stop_event, workers=4)
    try:
        # under load, with a request running on d (each takes 8 x 20 ms)
        wait_for(lambda: result.served_by.get("d", 0) > 0 and stub_stats(url)["in_flight"] > 0)
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9, mid-load
        proc.wait()
        ok_at_kill = result.ok
        # until requests met the dead d (the data plane marks it failed, each sent on elsewhere) and 20 more
        # were served after the kill; a failure ends the wait (asserted below)
        wait_for(lambda: result.failed or (result.ok >= ok_at_kill + 20 and not next(
            b for b in router.backends() if b.url == url).healthy))
    finally:
        stop_event.set()
        for thread in threads:
            thread.join(30)
    assert result.failed == [] and result.served_by.get("d", 0) > 0
    assert result.ok > 20
    assert router.remove(url, drain_s=1) is False  # the control plane takes it out; dead: nothing to drain
    assert url not in [b.url for b in router.backends()]


# ---------------------------------------------------------------- holding, limits, malformed requests

def test_a_request_held_while_the_pool_is_empty_is_served_by_a_backend_added_meanwhile(strict, stubs):
    backends, _ = stubs
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        waiting = pool.submit(_complete, strict)
        time.sleep(0.5)
        assert not waiting.done()  # held, not refused
        strict.add(backends_url := next(iter(backends.values())))
        response = waiting.result(timeout=10)
    assert response.status_code == 200 and time.monotonic() - started < 1.5
    strict.remove(backends_url, drain_s=0)


def test_past_the_hold_an_empty_pool_answers_503_json_with_retry_after(strict):
    started = time.monotonic()
    response = _complete(strict)
    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    assert response.json()["error"]["code"] == "no_replica"
    assert 1.4 < time.monotonic() - started < 5


def _raw(router: Router, data: bytes, read: bool = True, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", router.port), timeout=timeout) as conn:
        conn.sendall(data)
        if not read:
            return b""
        chunks = []
        try:
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
        return b"".join(chunks)


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")) else 0


def _json_error(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


def test_malformed_huge_and_slow_requests_get_json_4xx_and_the_server_serves_on(strict, stubs):
    backends, _ = stubs
    url = next(iter(backends.values()))
    strict.add(url)
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    try:
        garbage = _raw(strict, b"\x16\x03\x01 nonsense\r\n\r\n")
        assert _status(garbage) == 400 and _json_error(garbage)["code"] == "bad_request"
        too_long = _raw(strict, b"GET /" + b"x" * 20000 + b" HTTP/1.1\r\nHost: h\r\n\r\n")
        assert _status(too_long) == 400  # request line over aiohttp's limit
        absolute = _raw(strict, b"GET http://elsewhere/ HTTP/1.1\r\nHost: h\r\n" + auth + b"\r\n")
        assert _status(absolute) == 400  # no forward proxying
        huge = _raw(strict, b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 2000000\r\n" + auth + b"\r\n",
                    timeout=5)
        assert _status(huge) == 413 and _json_error(huge)["code"] == "request_too_large"
        chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n" + auth + b"\r\n"
                   + (b"100000\r\n" + b"x" * 0x100000 + b"\r\n") * 2 + b"0\r\n\r\n")
        assert _status(_raw(strict, chunked)) == 413
        # A body that is not UTF-8, read as JSON (typed so, or untyped): the data plane refuses it itself, a 400
        # in OpenAI's error shape (vLLM 0.32 answers FastAPI's {"detail": ...}); no engine sees it.
        body = b'{"model": "stub", "prompt": "\xff\xfe bad utf-8"}'

        def post(content_type: bytes) -> tuple[bytes, dict]:
            answer = _raw(strict, b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nConnection: close\r\n" + content_type
                          + b"Content-Length: " + str(len(body)).encode() + b"\r\n" + auth + b"\r\n" + body)
            head = answer.split(b"\r\n\r\n", 1)[0].lower()
            assert _status(answer) == 400 and b"\r\ncontent-type: application/json" in head, answer[:300]
            error = _json_error(answer)
            assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
            return head, error

        for typed in (b"Content-Type: application/json\r\n", b""):
            head, error = post(typed)
            assert error["code"] == "invalid_request_body" and b"\r\nx-backend:" not in head, (typed, head, error)
        # Typed otherwise, no engine reads it as JSON: it goes on, the engine's 400 (OpenAI's shape) comes back
        head, error = post(b"Content-Type: text/plain\r\n")
        assert b"\r\nx-backend: " in head and error["code"] == 400, (head, error)  # the stand-in named itself
        bad_header = _raw(strict, b"GET /v1/models HTTP/1.1\r\nHost: h\r\nConnection: close\r\n"
                          b"Authorization: Bearer \xff\xfe\r\n\r\n")
        assert _status(bad_header) == 401
        # a slow client: headers never finished; then a body that never comes
        started = time.monotonic()
        assert _raw(strict, b"POST /v1/completions HTTP/1.1\r\nHost: h\r\n", timeout=10) == b""  # closed
        assert time.monotonic() - started < 5
        slow_body = _raw(strict, b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 100\r\n" + auth
                         + b"\r\n{", timeout=10)
        assert _status(slow_body) == 408 and _json_error(slow_body)["code"] == "request_timeout"
        assert _complete(strict).status_code == 200  # and it serves on
        metrics = strict.metrics()
        assert "hpcserve_router_malformed_requests_total 2.0" in metrics
    finally:
        strict.remove(url, drain_s=0)


def test_connections_above_the_cap_get_503_at_once(strict):
    idle = [socket.create_connection(("127.0.0.1", strict.port), timeout=5) for _ in range(6)]
    try:
        time.sleep(0.2)
        refused = _raw(strict, b"GET /health HTTP/1.1\r\nHost: h\r\n\r\n")
        assert _status(refused) == 503 and _json_error(refused)["code"] == "too_many_connections"
    finally:
        for conn in idle:
            conn.close()
    wait_for(lambda: httpx.get(f"{strict.url}/health", timeout=5).status_code == 200)


# ---------------------------------------------------------------- policies

def test_unequal_capacity_gets_traffic_in_proportion(tmp_path):
    # stand-ins that run 8 and 1 requests at once (as engines with --max-num-seqs 8 and 1), 10 concurrent
    # streams; each takes 4 x 80 ms, so the slots, not a busy machine's CPU, limit what each serves
    started = start_stubs(["big", "small"], tmp_path, token_delay_ms=80, slots=[8, 1], tokens=4)
    router = make_router(tmp_path, "capacity")
    try:
        router.start([])
        router.apply(add=[url for _, url in started], capacities={started[0][1]: 8, started[1][1]: 1})

        client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=10), headers=headers())

        def one(index: int) -> str:  # one shared keep-alive client: 10 streams really in flight at once
            body = {"model": "stub", "prompt": f"p{index}", "max_tokens": 4, "stream": True}
            with client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
                response.read()
                return response.headers["x-backend"]

        with client, ThreadPoolExecutor(10) as workers:
            served = Counter(workers.map(one, range(60)))
        assert served["big"] >= 3 * served["small"], served
    finally:
        router.stop()
        router.close()
        for proc, _ in started:
            stop(proc)


def test_prefix_policy_keeps_a_session_or_a_shared_prompt_on_one_backend(stubs):
    backends, directory = stubs
    router = make_router(directory, "prefix", policy=Routing.PREFIX)
    try:
        router.start(list(backends.values()))
        shared = "You are a helpful assistant. " * 80  # 2.4 KB: longer than the affinity key

        def by(prompt: str, session: str | None = None) -> str:
            extra = {"X-Session-ID": session} if session else {}
            response = HTTP.post(f"{router.url}/v1/completions", headers={**headers(), **extra},
                                 json={"model": "stub", "prompt": prompt, "max_tokens": 2})
            return response.headers["x-backend"]

        assert len({by(f"{shared} question {i}") for i in range(8)}) == 1
        assert len({by(f"different {i}", session="s-42") for i in range(8)}) == 1
        assert len({by("same", session=f"s-{i}") for i in range(16)}) == 2  # sessions spread over both
    finally:
        router.stop()
        router.close()


# ---------------------------------------------------------------- the process: start, attach, stop

def test_attach_and_stop_by_recorded_pid_from_another_controller(tmp_path, stubs):
    backends, _ = stubs
    router = make_router(tmp_path, "own")
    router.start(backends.values())
    pid = router.pid
    with pytest.raises(RouterError, match="does not answer /health"):
        router.add(f"http://127.0.0.1:{free_port()}")
    other = make_router(tmp_path, "own")
    other.port = router.port
    assert other.attach(os.getpid()) is False  # not a data plane
    assert other.attach(pid) is True and other.pid == pid  # a new controller takes it over, running
    assert sorted(b.url for b in other.backends()) == sorted(backends.values())
    assert other.remove(next(iter(backends.values())), drain_s=0) is True
    assert len(router.backends()) == 1  # one data plane, seen by both
    assert _complete(other).status_code == 200
    assert stop_router(pid, timeout_s=10) is True
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    router.stop()  # reaps it; stopping twice is harmless
    assert stop_router(os.getpid()) is False  # a PID that is not a router is never signalled
    for each in (router, other):
        each.close()


def test_key_file_readable_by_others_stops_the_router_with_the_reason(tmp_path):
    path = key_file(tmp_path)
    path.chmod(0o644)
    router = make_router(tmp_path, "r", key=path)
    with pytest.raises(RouterError, match="exited with code 2.*chmod 600"):
        router.start()
    router.stop()
    router.close()


def test_without_a_key_file_the_endpoint_is_open(tmp_path, stubs):
    backends, _ = stubs
    router = make_router(tmp_path, "open", key=None)
    try:
        router.start(backends.values())
        response = _complete(router, key=None)  # passed to the engine, which checks its own key
        assert response.status_code == 401 and response.json() == {"error": "Unauthorized"}
        assert response.headers["x-backend"] in ("a", "b")
        assert "no --key-file" in (tmp_path / "open.log").read_text()
    finally:
        router.stop()
        router.close()
