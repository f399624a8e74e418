"""Layers 1-2 on a real Slurm cluster (the sandbox): sbatch -> Ray over the allocation -> health check.

Failures must be named: a node killed while Ray starts, a node set down before submission, a job past
its time limit. Nothing may stay running on any node afterwards.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from helpers import run_cli, write_config

pytestmark = pytest.mark.sandbox
HERE = Path(__file__).parent


@pytest.fixture()
def slurm_env(sandbox, hpcserve_home, monkeypatch):
    for key, value in sandbox.env().items():
        monkeypatch.setenv(key, value)
    yield sandbox.env()
    assert_nodes_clean(sandbox)


def assert_nodes_clean(sandbox, timeout_s: float = 30) -> None:
    """Only each node's init and slurmd remain (no Ray, no vLLM, no job step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        extra = {n: len(sandbox.node_pids(n)) - 2 for n in sandbox.node_names()}
        if not any(extra.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not any(extra.values()), f"processes left on nodes: {extra}"


def squeue_empty(env) -> bool:
    out = subprocess.run(["squeue", "--noheader"], capture_output=True, text=True, env={**env}, timeout=30)
    return out.stdout.strip() == ""


def test_three_nodes_form_one_ray_cluster_and_pass_the_check(slurm_env, tmp_path):
    config = write_config(tmp_path / "check.yaml", HERE / "sandbox-check.yaml", results_dir=str(tmp_path / "results"))
    done = run_cli("check", str(config), timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = next((tmp_path / "results" / "logs").glob("sb-check-check-*"))
    health = json.loads((run_dir / "health.json").read_text())
    assert health["ok"]
    addresses = {n["address"] for n in health["nodes"]}
    assert addresses == {"198.18.0.11", "198.18.0.12", "198.18.0.13"}
    assert {n["hostname"] for n in health["nodes"]} == {"hsn1", "hsn2", "hsn3"}
    assert all(len(n["ray_gpu_ids"]) == 2 for n in health["nodes"])  # the fake GPUs, from the allocation
    pairs = {(t["source"], t["destination"]) for t in health["transfers"]}
    assert len(pairs) == 6 and all(t["seconds"] > 0 for t in health["transfers"])
    assert health["collective"]["world_size"] == 3 and health["collective"]["error"] is None
    assert health["placement_group_s"] is not None and health["task_rtt_ms"] > 0
    # one results folder: rendered script, Slurm output, every node's logs, the timeline
    for name in ("job.sbatch", "slurm.out", "timeline.json", "config.yaml"):
        assert (run_dir / name).is_file(), name
    for node in ("hsn1", "hsn2", "hsn3"):
        assert (run_dir / "nodes" / node / "ray-start.log").is_file()
        assert (run_dir / "nodes" / node / "ray").is_dir(), f"{node}'s Ray logs were not collected"
    # Nothing a fixed allocation does not need: no log monitor, no autoscaler monitor (each would have its log)
    head_logs = [p.name for p in (run_dir / "nodes" / "hsn1" / "ray").iterdir()]
    assert not [n for n in head_logs if n.startswith(("monitor.", "log_monitor."))], head_logs
    assert squeue_empty(slurm_env)


def wait_for_stage(results: Path, pattern: str, stage: str, timeout_s: float = 240) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for run_dir in (results / "logs").glob(pattern):
            timeline = json.loads((run_dir / "timeline.json").read_text()) if (run_dir / "timeline.json").exists() else []
            if any(e["stage"] == stage for e in timeline):
                return run_dir
        time.sleep(0.3)
    raise AssertionError(f"stage {stage} not reached")


def test_node_killed_during_ray_start_is_named(slurm_env, sandbox, tmp_path):
    config = write_config(tmp_path / "check.yaml", HERE / "sandbox-check.yaml", results_dir=str(tmp_path / "results"))
    proc = subprocess.Popen([*__import__("helpers").HPCSERVE, "check", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_stage(tmp_path / "results", "sb-check-check-*", "ray")
        sandbox.kill_node("hsn3")
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        sandbox.start_node("hsn3")
    assert proc.returncode == 1, out
    assert "hsn3" in out, out
    assert "Traceback" not in out
    assert squeue_empty(slurm_env)
    # the nodes' Ray folders in /tmp (the sandbox's nodes share it), the killed node's too, are gone
    folders = [json.loads(path.read_text())["temp_dir"] for path in (tmp_path / "results").glob("**/nodes/*/node.json")]
    assert folders and not [folder for folder in folders if Path(folder).exists()], folders


@pytest.mark.parametrize("router", [False, True], ids=["job", "endpoint"])
def test_node_set_down_before_submission_is_reported(slurm_env, tmp_path, router):
    # One replica spans the three nodes (six GPUs): the job, or with the endpoint in front its first member's
    # job (as many nodes as a replica), cannot start while one is down.
    subprocess.run(["scontrol", "update", "nodename=hsn2", "state=down", "reason=test"], check=True, timeout=30)
    try:
        config = write_config(tmp_path / "up.yaml", HERE / "sandbox-check.yaml", results_dir=str(tmp_path / "results"),
                              serve={"router": router}, parallelism={"tensor": 2, "pipeline": 3, "replicas": 1})
        done = run_cli("up", str(config), "--timeout", "15", timeout=120)
    finally:
        subprocess.run(["scontrol", "update", "nodename=hsn2", "state=resume"], check=True, timeout=30)
    assert done.returncode != 0
    text = " ".join((done.stdout + done.stderr).split())
    assert "PENDING" in text and "not ready after 15 s" in text, text
    assert "Traceback" not in text
    assert squeue_empty(slurm_env)  # the pending job was cancelled: nothing half-started


def test_job_past_time_limit_ends_as_timeout_and_status_says_so(slurm_env, tmp_path):
    # A one-minute job whose site setup outlasts it (a slow module load, say). Slurm's limits have
    # minute granularity: the job ends after ~60-90 s.
    config = write_config(tmp_path / "t.yaml", HERE / "sandbox-check.yaml", name="sb-timeout",
                          results_dir=str(tmp_path / "results"),
                          cluster={"nodes": 1, "time": "1", "setup": ["sleep 600"]})
    done = run_cli("up", str(config), timeout=300)
    text = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1, text
    assert "TIMEOUT" in text, text
    status = run_cli("status", "sb-timeout", "--json")
    row = json.loads(status.stdout)[0]
    assert "TIMEOUT" in row["runner"] and row["status"] in ("dead", "failed")
    run_cli("down", "sb-timeout")
