"""Real Ray: the EngineHost actor runs as a Ray worker (niceness 15, OMP_NUM_THREADS=1 for its 0.01 CPU),
but the process it starts gets the raylet's (the job's) niceness, oom_score_adj and environment."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

PROBE = ("import json, os; print(json.dumps({'nice': os.getpriority(os.PRIO_PROCESS, 0), "
         "'oom': int(open('/proc/self/oom_score_adj').read()), 'env': dict(os.environ)}))")


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    saved = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "RAY_AUTH_MODE")}
    os.environ.pop("OMP_NUM_THREADS", None)  # the job sets none: Ray's own choice shows
    # No token: with auth on, Ray 2.60 writes ~/.ray/auth_token, which changes later `ray start`s.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Ray's files in a folder of the test's own, removed at the end: by default ray.init puts its session
    # in /tmp/ray and leaves it there after shutdown, its subfolders world-writable. Short (Ray's Unix socket
    # paths have at most 107 bytes), 0700.
    temp = Path(tempfile.mkdtemp(prefix="hps-ray-", dir="/tmp"))
    try:
        ray.init(num_cpus=1, num_gpus=0, include_dashboard=False, log_to_driver=False, _temp_dir=str(temp))
        session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
        yield ray
    finally:
        ray.shutdown(wait_for_processes=True)  # none of Ray's processes writes there any more
        shutil.rmtree(temp, ignore_errors=True)
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    # the session was ours, and nothing of it is left (in /tmp/ray, where ray.init puts it by default)
    left = [path for path in (temp, Path("/tmp/ray") / session.name) if path.exists()]
    assert session.parent == temp and not left, f"Ray's session folder {session} survived the stop: {left}"


@pytest.mark.slow
def test_engine_process_is_started_like_a_job_process(ray_local, tmp_path):
    from hpcserve.engine.host import EngineHost

    host = ray_local.remote(EngineHost).options(num_cpus=0.01).remote()
    host_like = ray_local.remote(_probe_class()).options(num_cpus=0.01).remote()  # the same Ray options
    log = tmp_path / "engine.log"
    ray_local.get(host.start.remote([sys.executable, "-c", PROBE], {"HPCSERVE_X": "1"}, str(log), True))
    deadline = time.monotonic() + 30
    while ray_local.get(host.returncode.remote()) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    child = json.loads(log.read_text().strip().splitlines()[-1])
    raylet_pid = ray_local.get(_raylet_pid.remote())
    assert "OMP_NUM_THREADS" not in child["env"] and "RAY_JOB_ID" not in child["env"]
    assert child["env"]["HPCSERVE_X"] == "1"
    assert child["nice"] == os.getpriority(os.PRIO_PROCESS, raylet_pid)
    # What the host itself got from Ray, and what its child inherited before engine/host.py took the
    # job's settings back: one OpenMP thread and, where Ray may renice, a lower priority.
    worker = ray_local.get(host_like.probe.remote())
    assert worker["omp"] == "1"
    if os.geteuid() == 0:  # Ray renices its workers (15 by default); only root may lower it again
        assert worker["nice"] > child["nice"]
        assert child["oom"] == int(open(f"/proc/{raylet_pid}/oom_score_adj").read())


def _remote(fn):
    import ray

    return ray.remote(num_cpus=0.01)(fn)


@_remote
def _raylet_pid() -> int:
    return int(os.environ["RAY_RAYLET_PID"])


def _probe_class():
    """Defined in a function so that Ray ships it by value (the workers cannot import this test module)."""

    class Probe:
        def probe(self) -> dict:
            return {"omp": os.environ.get("OMP_NUM_THREADS"), "nice": os.getpriority(os.PRIO_PROCESS, 0)}

    return Probe


@pytest.mark.slow
def test_an_actor_can_ask_ray_not_to_renice_it(ray_local):
    """What engine/replicas.py can give EngineHost so that unprivileged users (no CAP_SYS_NICE, where
    the child's renice is refused) still get the job's priority: Ray's job supervisor does the same."""
    niced = ray_local.remote(_probe_class()).options(num_cpus=0.01).remote()
    kept = ray_local.remote(_probe_class()).options(num_cpus=0.01,
                                            runtime_env={"env_vars": {"RAY_worker_niceness": "0"}}).remote()
    job_nice = os.getpriority(os.PRIO_PROCESS, ray_local.get(_raylet_pid.remote()))
    assert ray_local.get(kept.probe.remote())["nice"] == job_nice
    assert ray_local.get(niced.probe.remote())["nice"] > job_nice
