"""The router (sglang-router data plane + our control) in front of real backend processes: the fast
OpenAI stand-in (router_stub). The same behaviour in front of real vLLM engines: test_router_vllm.py.
Every process here is started and stopped by its PID."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from helpers import free_port
from router_fixtures import (
    KEY,
    headers,
    key_file,
    run_load,
    start_stub,
    stop,
    stream_times,
)

from hpcserve.endpoint.rotation import Rotation, backends_to_pause, next_paused
from hpcserve.endpoint.router import (
    Router,
    RouterError,
    backends_from_json,
    launcher_argv,
    stop_router,
)
from hpcserve.endpoint.router_main import read_key_file
from hpcserve.engine.metrics import EngineLoad, engine_load, is_drained, is_saturated

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
"""


# ---------------------------------------------------------------- pure parts

def test_engine_load_from_vllm_metrics():
    load = engine_load(VLLM_METRICS)
    assert load == EngineLoad(running=3.0, waiting=2.0, kv_cache_usage=0.5)
    assert load.in_flight == 5 and not is_drained(load)
    assert is_drained(engine_load("# nothing\n"))
    assert is_saturated(load) and not is_saturated(EngineLoad(1, 0, 0.2))
    assert is_saturated(EngineLoad(1, 0, 0.97))


def test_saturated_backends_pause_and_come_back():
    busy, idle, full = EngineLoad(4, 3, 0.5), EngineLoad(1, 0, 0.2), EngineLoad(2, 0, 0.97)
    assert backends_to_pause({"a": busy, "b": idle, "c": full}, set()) == {"a", "c"}
    assert backends_to_pause({"a": busy, "b": busy}, set()) == set()  # never all of them
    # hysteresis: a paused backend stays out until its queue is empty and its KV cache below 85 %
    assert backends_to_pause({"a": EngineLoad(3, 0, 0.9), "b": idle}, {"a"}) == {"a"}
    assert backends_to_pause({"a": EngineLoad(3, 0, 0.5), "b": idle}, {"a"}) == set()
    assert backends_to_pause({"a": None, "b": idle}, {"a"}) == {"a"}  # no figures: left as it is
    assert backends_to_pause({"a": None, "b": idle}, set()) == set()


def test_rotation_never_loses_a_backend_whose_probe_timed_out():
    # Seen on the sandbox under load (all requests then got 503 "No available workers"): m0 paused, then
    # its probe timed out once while m1 queued; m0 was forgotten (out of the router, not marked paused),
    # and the next round paused m1, the last backend still in the router.
    busy, idle = EngineLoad(2, 5, 0.5), EngineLoad(1, 0, 0.2)
    pool = ["m0", "m1"]
    paused = next_paused(pool, {"m0", "m1"}, {"m0": busy, "m1": idle}, set())
    assert paused == {"m0"}
    paused = next_paused(pool, {"m1"}, {"m0": busy, "m1": busy}, paused)  # m0's probe timed out
    assert paused == {"m0"}  # still known as paused: m1, the only one judged, is never paused
    paused = next_paused(pool, {"m0", "m1"}, {"m0": idle, "m1": busy}, paused)
    assert paused == {"m1"}  # m0 comes back as m1 goes out: one of them is always in the router
    assert next_paused(["m0"], {"m0"}, {"m0": busy}, {"m1"}) == set()  # m1 left the pool: forgotten


class RecordingRouter:
    """Stands in for the router's admin API: who is in rotation after each call."""

    def __init__(self, members: set[str], refuse: set[str] = frozenset()):
        self.members, self.refuse, self.seen = set(members), refuse, []

    def add(self, url: str) -> None:
        if url in self.refuse:
            raise RouterError(f"{url} does not answer /health")
        self.members.add(url)
        self.seen.append(set(self.members))

    def remove(self, url: str, drain_s: float) -> None:
        self.members.discard(url)
        self.seen.append(set(self.members))

    def apply(self, add=(), remove=()) -> set[str]:
        """Router.apply: the adds, then the removes; the backends it could not add."""
        refused = set()
        for url in add:
            try:
                self.add(url)
            except RouterError:
                refused.add(url)
        for url in remove:
            self.remove(url, 0)
        return refused


def test_rotation_swaps_backends_without_a_moment_of_none():
    # Removing before adding left the router empty for ~60 ms: 36 of 200 requests got 503 on the sandbox.
    busy, idle = EngineLoad(2, 5, 0.5), EngineLoad(1, 0, 0.2)
    router = RecordingRouter({"a"})
    rotation = Rotation(router)
    rotation.paused = {"b"}
    rotation.update(["a", "b"], {"a", "b"}, {"a": busy, "b": idle})
    assert rotation.paused == {"a"} and router.members == {"b"}
    assert all(router.seen), router.seen  # never empty in between


def test_rotation_keeps_one_backend_when_the_one_to_resume_fails():
    busy, idle = EngineLoad(2, 5, 0.5), EngineLoad(1, 0, 0.2)
    router = RecordingRouter({"a"}, refuse={"b"})
    rotation = Rotation(router)
    rotation.paused = {"b"}
    rotation.update(["a", "b"], {"a", "b"}, {"a": busy, "b": idle})
    assert rotation.paused == {"b"} and router.members == {"a"}  # a stays, though it queues


def test_key_file_readable_by_others_stops_the_router_with_the_reason(tmp_path):
    path = key_file(tmp_path)
    path.chmod(0o644)
    router = Router("127.0.0.1", free_port(), path, tmp_path / "r.log")
    with pytest.raises(RouterError, match="exited with code 2.*chmod 600"):
        router.start()
    router.stop()
    router.close()


def test_power_of_two_needs_two_backends_at_start(tmp_path):
    router = Router("127.0.0.1", free_port(), key_file(tmp_path), tmp_path / "r.log", policy="power_of_two")
    with pytest.raises(RouterError, match="at least 2 backends"):
        router.start(["http://127.0.0.1:1"])
    assert router.pid is None
    router.close()


def test_backends_from_workers_json():
    data = {"workers": [{"url": "http://h:1", "model_id": "unknown", "is_healthy": True, "load": 2},
                        {"url": "http://h:2", "is_healthy": False, "load": -1}]}
    assert [(b.url, b.healthy, b.in_flight) for b in backends_from_json(data)] == [
        ("http://h:1", True, 2), ("http://h:2", False, 0)]


def test_no_secret_on_the_command_line(tmp_path):
    argv = launcher_argv("127.0.0.1", 1, 2, key_file(tmp_path), "round_robin", ["http://h:1/"])
    assert KEY not in " ".join(argv) and "--api-key-file" in argv and argv[argv.index("--backend") + 1] == "http://h:1"


def test_key_file_readable_by_others_is_refused(tmp_path):
    path = key_file(tmp_path)
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_key_file(path)


# ---------------------------------------------------------------- a real router before stubs

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    directory = tmp_path_factory.mktemp("router")
    stubs = dict(start_stub(name, directory) for name in ("a", "b"))  # proc -> url
    router = Router("127.0.0.1", free_port(), key_file(directory), directory / "router.log", model="stub")
    try:
        router.start(list(stubs.values()))
        yield router, stubs, directory
    finally:
        router.stop()
        router.close()
        for proc in stubs:
            stop(proc)


def _complete(router: Router, key: str | None = KEY, **body) -> httpx.Response:
    body = {"model": "stub", "prompt": "Hello", "max_tokens": 4, **body}
    return httpx.post(f"{router.url}/v1/completions", json=body, headers=headers(key) if key else {}, timeout=30)


def test_key_enforced_at_the_router(pool):
    router, stubs, _ = pool
    before = sum(httpx.get(f"{url}/stub/stats").json()["requests"] for url in stubs.values())
    assert _complete(router, key=None).status_code == 401
    assert _complete(router, key="wrong").status_code == 401
    after = sum(httpx.get(f"{url}/stub/stats").json()["requests"] for url in stubs.values())
    assert after == before  # refused by the router itself: no backend saw them
    assert _complete(router).status_code == 200
    assert router.probe() == "xxxxxxxx"  # a real completion through the router (the stub's 8 tokens)
    chat = httpx.post(f"{router.url}/v1/chat/completions", headers=headers(), timeout=30,
                      json={"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == "xxx"
    with pytest.raises(RouterError, match="401"):  # the admin API needs the key too
        Router._admin(_keyless(router), "GET", "/workers")


def _keyless(router: Router) -> Router:
    clone = Router.__new__(Router)
    clone.__dict__.update(router.__dict__)
    clone._key = None
    return clone


def test_client_errors_do_not_take_backends_out(pool):
    router, _, _ = pool
    for _ in range(8):  # more than the circuit breaker's failure threshold, on every backend
        assert _complete(router, prompt="__answer_400__").status_code == 400
    assert all(_complete(router).status_code == 200 for _ in range(4))
    assert all(b.healthy for b in router.backends())
    assert "vllm_router" in httpx.get(router.metrics_url, timeout=5).text  # its own metrics, on loopback


def test_streaming_passes_through_incrementally(pool):
    router, _, _ = pool
    times, lines = stream_times(router.url, {"model": "stub", "prompt": "Hi", "max_tokens": 20})
    assert lines[-1] == "data: [DONE]" and len(lines) == 21
    # the stub sends one token per 20 ms: chunks must arrive spread over ~400 ms, not all at the end
    assert times[-1] - times[0] > 0.3 and times[1] < times[-1] / 2


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


def test_removed_backend_drains_and_gets_nothing_new(pool, tmp_path):
    router, stubs, directory = pool
    proc, url = start_stub("c", directory, token_delay_ms=50)
    try:
        router.add(url)
        # a long stream on c (its own unique prompt goes to the least busy backend: c is idle)
        for other in stubs.values():
            router.remove(other, drain_s=5)
        got: dict = {}
        reader = threading.Thread(target=lambda: got.update(zip(("times", "lines"), stream_times(
            router.url, {"model": "stub", "prompt": "drain me", "max_tokens": 40}))))
        reader.start()
        _wait(lambda: httpx.get(f"{url}/stub/stats").json()["in_flight"] == 1)
        for other in stubs.values():
            router.add(other)
        assert httpx.get(f"{url}/stub/stats").json()["in_flight"] == 1  # still streaming when removed
        assert router.remove(url, drain_s=30) is True
        # it waited for the stream (40 x 50 ms): nothing runs on c once remove returned
        assert httpx.get(f"{url}/stub/stats").json()["in_flight"] == 0
        served_before = httpx.get(f"{url}/stub/stats").json()["requests"]
        for _ in range(6):
            assert _complete(router).status_code == 200
        assert httpx.get(f"{url}/stub/stats").json()["requests"] == served_before  # nothing new on c
        reader.join(30)
        assert got["lines"][-1] == "data: [DONE]" and len(got["lines"]) == 41  # the stream finished whole
    finally:
        stop(proc)


def test_killed_backend_costs_no_request_and_new_backend_gets_traffic(pool):
    router, stubs, directory = pool
    proc, url = start_stub("d", directory)
    router.add(url)
    stop_event = threading.Event()
    threads, result = run_load(router.url, "stub", stop_event, workers=4)
    try:
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9, mid-load
        proc.wait()
        time.sleep(2.0)
    finally:
        stop_event.set()
        for thread in threads:
            thread.join(30)
    assert result.failed == [] and result.served_by.get("d", 0) > 0
    assert result.ok > 20
    router.remove(url, drain_s=1)  # the control plane takes it out; a dead engine has nothing to drain
    assert url not in [b.url for b in router.backends()]


def test_stop_by_recorded_pid_from_another_controller(tmp_path):
    router = Router("127.0.0.1", free_port(), key_file(tmp_path), tmp_path / "router.log")
    router.start()
    pid = router.pid
    assert not router.ready()  # no backend yet
    with pytest.raises(RouterError, match="does not answer /health"):
        router.add(f"http://127.0.0.1:{free_port()}")
    assert stop_router(pid, timeout_s=10) is True
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    router.stop()  # reaps it; stopping twice is harmless
    assert stop_router(os.getpid()) is False  # a PID that is not a router is never signalled
    router.close()


def _wait(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_without_a_key_file_the_endpoint_is_open(tmp_path):
    proc, url = start_stub("open", tmp_path, key="")
    router = Router("127.0.0.1", free_port(), None, tmp_path / "router.log", model="stub")
    try:
        router.start([url])
        assert _complete(router, key=None).status_code == 200
        assert "no --api-key-file" in (tmp_path / "router.log").read_text()
    finally:
        router.stop()
        router.close()
        stop(proc)
