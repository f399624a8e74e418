"""Adoption with the real router and controller in front of stand-in replicas, in seconds.

The run folder is what a killed controller leaves behind: its state.json lists two serving members (their
"drivers" are stand-in engines here, found by PID as local members are), the router it started still
runs and holds a third backend nobody knows. `status` must tell each part as it is, `hpcserve adopt`
must take over without touching a replica, and the router's backend list becomes the adopted ones. Then
the router dies too, and `hpcserve up` of the same config adopts again with a new router on the same
port and key. The same on real Slurm, Ray and vLLM under load: tests/cluster/test_adopt.py.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from helpers import REPO, free_port, run_cli, write_config
from router_fixtures import start_stub, stop

from hpcserve import api
from hpcserve.core.files import write_json, write_secret
from hpcserve.core.keys import ApiKey, store_key
from hpcserve.core.registry import Record, load_record, save_record
from hpcserve.core.runstate import RunState
from hpcserve.core.statuses import MemberRole, MemberStatus, RunKind, RunStatus, Stage
from hpcserve.endpoint.control.members import Member
from hpcserve.endpoint.control.plane_client import Router, stop_router
from hpcserve.testing.harness import wait_until

NAME = "st-adopt"
KEY = "adopt-test-key"


def dead_process() -> tuple[int, float]:
    """The PID and start time of a controller that is gone."""
    proc = psutil.Popen([sys.executable, "-c", "pass"])
    started = proc.create_time()
    proc.wait()
    return proc.pid, started


def member(index: int, stub: subprocess.Popen, url: str, results: Path) -> dict:
    run_dir = results / "members" / "logs" / f"{NAME}-m{index}"
    run_dir.mkdir(parents=True)
    write_json(run_dir / "state.json", {"status": "ready", "replicas": [{"index": 0, "url": url, "nodes": ["here"]}]})
    record = Record(name=f"{NAME}-m{index}", scheduler="local", run_dir=str(run_dir), driver_pid=stub.pid,
                    driver_started=psutil.Process(stub.pid).create_time(), host=socket.gethostname())
    return Member(f"{NAME}-m{index}", index, MemberRole.INITIAL, {"tensor": 1, "pipeline": 1, "replicas": 1},
                  record.to_dict(), status=MemberStatus.SERVING, backends=[url], ready_s=1.0).to_json()


@pytest.fixture()
def orphan(hpcserve_home, tmp_path, monkeypatch):
    """An endpoint whose controller was killed: router and two replicas running, and a stranger in the router."""
    monkeypatch.delenv("HPCSERVE_API_KEY", raising=False)
    port = free_port()
    config = write_config(tmp_path / "adopt.yaml", REPO / "examples" / "local.yaml", name=NAME,
                          serve={"port": port}, results_dir=str(tmp_path / "results"))
    run_dir = tmp_path / "results" / "logs" / f"{NAME}-endpoint"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(api.load_config(config).model_dump(mode="json")))
    store_key(run_dir, ApiKey(KEY, "$HPCSERVE_API_KEY"))
    stubs = [start_stub(name, tmp_path, key=KEY) for name in ("m0", "m1", "stranger")]
    for proc, _ in stubs:  # reaped as soon as `down` stops them (a zombie child would look alive to it)
        threading.Thread(target=proc.wait, daemon=True).start()
    router = Router("127.0.0.1", port, write_secret(run_dir / ".router_key", KEY), run_dir / "router.log", model="tiny")
    router.start([url for _, url in stubs])
    pid, started = dead_process()
    write_json(run_dir / "timeline.json", [{"stage": Stage.READY, "event": "started", "time": time.time()}])
    write_json(run_dir / "state.json", {
        "status": "ready", "stage": "ready", "driver_pid": pid,
        "endpoint": {"url": router.url, "pid": router.pid},
        "members": [member(i, stub, url, run_dir) for i, (stub, url) in enumerate(stubs[:2])],
        "replicas": [{"index": i, "url": url, "model": "tiny"} for i, (_, url) in enumerate(stubs[:2])]})
    save_record(Record(name=NAME, scheduler="local", run_dir=str(run_dir), driver_pid=pid, driver_started=started,
                       kind=RunKind.ENDPOINT, host=socket.gethostname()))
    yield {"config": config, "run_dir": run_dir, "router": router, "stubs": stubs, "url": router.url}
    run_cli("down", NAME)
    router.stop()  # reaps the first router (this process started it), stopped already by then
    for proc, _ in stubs:
        stop(proc)


def completion(url: str, key: str | None = KEY) -> int:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                      headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30).status_code


def in_router(router: Router) -> set[str]:
    return {b.url for b in router.backends()}


def actions(run_dir: Path) -> list[str]:
    return [d.action for d in RunState.read(run_dir).decisions]


def test_adopt_takes_over_without_restarting_and_status_tells_the_truth_meanwhile(orphan):
    run_dir, router, (m0, m1, _stranger) = orphan["run_dir"], orphan["router"], [u for _, u in orphan["stubs"]]
    seen = api.status(NAME)[0]
    assert seen.status is RunStatus.UNCONTROLLED, seen
    assert f"router pid {router.pid} serving" in seen.runner and "controller pid" in seen.runner
    assert [r["healthy"] for r in seen.replicas] == [True, True]
    assert "hpcserve adopt st-adopt" in seen.advice
    assert [m["status"] for m in seen.members] == ["serving", "serving"]
    table = run_cli("status", NAME, env={"COLUMNS": "80"}).stdout
    assert "uncontrolled" in table and f"router pid {router.pid} serving" in table and "hpcserve adopt" in table

    # A config that differs from the running one: one message, exit 2, nothing started.
    other = write_config(orphan["config"].parent / "other.yaml", orphan["config"], serve={"port": free_port()})
    refused = run_cli("up", str(other))
    assert refused.returncode == 2 and "serve.port" in refused.stderr and "Traceback" not in refused.stderr
    assert load_record(NAME).driver_pid == RunState.read(run_dir).driver_pid  # no new controller

    done = run_cli("adopt", NAME)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "adopted" in done.stdout
    state = RunState.read(run_dir)
    assert state.status is RunStatus.READY and state.router_pid == router.pid  # the same router, kept
    assert actions(run_dir).count("adopted") == 3  # the router and both members
    assert "adopt: removed backend" in actions(run_dir) and in_router(router) == {m0, m1}
    assert completion(router.url) == 200
    assert api.status(NAME)[0].status is RunStatus.READY
    again = run_cli("adopt", NAME)
    assert again.returncode == 0 and "nothing to adopt" in again.stdout
    # The controller's decisions in endpoint.log, with time, level and origin; --level leaves out the INFO ones.
    shown = run_cli("logs", NAME, "--component", "driver", "--lines", "400").stdout
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO hpcserve\.endpoint\.control\.controller\[\d+\]: "
                     r"adopt: removed backend: ", shown, re.MULTILINE), shown
    quiet = run_cli("logs", NAME, "--component", "driver", "--level", "warning")
    assert quiet.returncode == 0 and "adopt: removed backend" not in quiet.stdout, quiet.stdout
    assert "unknown level 'loud'" in run_cli("logs", NAME, "--level", "loud").stderr

    # Now the "login node" is lost: controller and router killed. `up` of the same config adopts again.
    os.kill(state.driver_pid, signal.SIGKILL)
    stop_router(router.pid, timeout_s=0.1)
    wait_until(lambda: api.status(NAME)[0].status is RunStatus.UNCONTROLLED, 10, "status sees the controller gone")
    assert "router gone" in api.status(NAME)[0].runner
    started = time.time()
    done = run_cli("up", str(orphan["config"]))
    assert done.returncode == 0, done.stdout + done.stderr
    state = RunState.read(run_dir)
    assert state.router_pid != router.pid and state.endpoint_url == router.url  # new router, same port
    assert [d.action for d in state.decisions if d.time >= started].count("adopted") == 2  # both members
    assert "router restarted" in actions(run_dir)
    assert completion(router.url) == 200 and completion(router.url, key=None) == 401  # same key
    assert in_router(router) == {m0, m1}
    assert all(proc.poll() is None for proc, _ in orphan["stubs"])  # no replica was restarted
