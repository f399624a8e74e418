"""The data plane as two worker processes on one port (--workers 2, serve.router_workers): both serve, they
route each prompt with what either of them sent, the supervisor's admin socket speaks for both, a worker
killed leaves the other serving, and stopping leaves no process or socket behind. Real processes in front
of stand-in engines."""

from __future__ import annotations

import os
import signal

import httpx
import psutil
import pytest
from helpers import free_port
from router_fixtures import headers, key_file, start_stubs, stop, wait_for

from hpcserve.core.net import shared_socket_folder
from hpcserve.core.statuses import Routing
from hpcserve.endpoint.control.plane_client import Router, is_router
from hpcserve.endpoint.dataplane.workers import worker_socket


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("workers")
    started = start_stubs(["a", "b"], directory, token_delay_ms=0)
    router = Router("127.0.0.1", free_port(), key_file(directory), directory / "workers.log", model="stub",
                    admin_socket=directory / "plane" / "admin.sock", policy=Routing.PREFIX, workers=2)
    try:
        router.start([url for _, url in started])
        yield router, started, directory
    finally:
        router.stop()
        router.close()
        for proc, _ in started:
            stop(proc)


def once(router: Router, prompt: str) -> str:
    """One completion on a connection of its own (the kernel picks a worker per connection)."""
    with httpx.Client(timeout=30, trust_env=False) as client:
        answer = client.post(f"{router.url}/v1/completions", headers={**headers(), "Connection": "close"},
                             json={"model": "stub", "prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    return answer.headers["x-backend"]


def per_worker_requests(router: Router) -> list[int]:
    counts = []
    for index in range(2):
        transport = httpx.HTTPTransport(uds=str(worker_socket(router.admin_socket, index)))
        with httpx.Client(transport=transport, base_url="http://w", timeout=5) as client:
            counts.append(sum(b["requests"] for b in client.get("/backends").json()["backends"]))
    return counts


def test_both_workers_serve_and_each_prompt_meets_the_replica_that_holds_it(two_workers):
    router, _, _ = two_workers
    workers = psutil.Process(router.pid).children()
    assert len(workers) == 2 and is_router(router.pid, router.port)
    assert all(not is_router(w.pid) and "hpcserve-router-worker" in " ".join(w.cmdline()) for w in workers)
    prompts = [f"prefix {p:02d} is shared by its repeats. " * 12 for p in range(8)]
    homes = {p: once(router, prompt + "first") for p, prompt in enumerate(prompts)}
    assert set(homes.values()) == {"a", "b"}
    for repeat in range(5):
        for p, prompt in enumerate(prompts):
            assert once(router, prompt + f"repeat {repeat}") == homes[p], (p, repeat)
    assert all(count > 0 for count in per_worker_requests(router))  # both took connections
    backends = router.backends()
    assert len(backends) == 2 and all(b.in_flight == 0 for b in backends)
    metrics = router.metrics()
    assert "hpcserve_router_workers 2.0" in metrics
    assert sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("hpcserve_router_backend_requests_total")) >= 48


def test_membership_reaches_every_worker(two_workers):
    router, started, _ = two_workers
    a_url = started[0][1]
    router.apply(remove=[a_url])
    try:
        assert {once(router, f"anything {i}") for i in range(12)} == {"b"}
    finally:
        router.add(a_url)
    assert {b.url for b in router.backends()} == {url for _, url in started}


def test_a_killed_worker_leaves_the_other_serving_and_stop_leaves_nothing(tmp_path):
    (proc, url), = start_stubs(["solo"], tmp_path, token_delay_ms=0)
    router = Router("127.0.0.1", free_port(), key_file(tmp_path), tmp_path / "kill.log", model="stub",
                    admin_socket=tmp_path / "plane" / "admin.sock", workers=2)
    try:
        router.start([url])
        workers = psutil.Process(router.pid).children()
        os.kill(workers[0].pid, signal.SIGKILL)
        wait_for(lambda: "1 serve on" in (tmp_path / "kill.log").read_text(), 5.0)
        assert all(once(router, f"after {i}") == "solo" for i in range(10))
        assert router.backends()[0].url == url  # the admin socket answers with the worker left
        group = [router.pid, workers[1].pid]
        router.stop()
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                       for pid in group)
        assert not list((tmp_path / "plane").iterdir())  # the admin socket and the workers' sockets are gone
    finally:
        router.stop()
        router.close()
        stop(proc)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_data_plane_whose_run_folder_is_too_deep_removes_its_shared_socket_folder(tmp_path, workers):
    deep = tmp_path / ("d" * 120)
    router = Router("127.0.0.1", free_port(), key_file(tmp_path), deep / "plane.log", model="stub", workers=workers)
    shared = router.admin_socket.parent
    assert deep not in router.admin_socket.parents and shared == shared_socket_folder()
    try:
        router.start([])
        assert router.admin_socket.is_socket()
        router.stop()
        assert not router.admin_socket.exists()
        # the user's other data planes (tests beside this one) may still have sockets there
        assert not shared.exists() or any(shared.iterdir())
    finally:
        router.stop()
        router.close()
