"""An endpoint of 6 members as real Slurm jobs on the sandbox, each job a stand-in member
(hpcserve.testing.member) instead of Ray and vLLM (32 nodes: benchmarks/scale_slurm.py):

- the controller asks Slurm about all of its members with one squeue per 5 s, whatever their number;
- every member's job gets its successor before its time limit and is drained (a rolling walltime
  handover of the whole pool), under a constant rate of requests through the endpoint: no request
  fails, no job ends by TIMEOUT, and nothing is left on the nodes afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import free_port
from test_slurm_ray import squeue_empty

from hpcserve.core.config import parse_config
from hpcserve.core.files import read_json
from hpcserve.core.keys import choose_key
from hpcserve.core.paths import RunPaths
from hpcserve.core.statuses import RunKind
from hpcserve.deployment.runs import LocalRun
from hpcserve.testing.endpoint import MEMBER_ENV
from hpcserve.testing.harness import wait_until

pytestmark = [pytest.mark.sandbox]
REPO = Path(__file__).parents[2]
MEMBERS = 6  # and their 6 successors: the 12 CPUs of the 3 nodes


def job_states(name: str, env: dict) -> dict[str, str]:
    out = subprocess.run(["squeue", "--noheader", "--states=all", "--format=%i|%T|%j"], capture_output=True,
                         text=True, env=env, timeout=30).stdout
    return {i: s for i, s, j in (line.split("|", 2) for line in out.splitlines()) if j.startswith(f"hpcserve-{name}-")}


def test_member_jobs_one_squeue_per_interval_and_a_rolling_handover(slurm_env, tmp_path):
    env = dict(os.environ)
    raw = {"name": "sb-scale", "model": {"path": "builtin:tiny-llama", "served_name": "stub"},
           "cluster": {"scheduler": "slurm", "nodes": MEMBERS, "cpus_per_node": 1, "gpus_per_node": 0, "time": "3"},
           "parallelism": {"replicas": MEMBERS},
           "serve": {"host": "0.0.0.0", "port": free_port(), "api_key_env": "HPCSERVE_API_KEY",
                     "handover_s": 100},
           # 3-minute jobs: the handovers, one at a time and planned backwards from the last job's end, begin
           # about 30 s in; the first 10 s are the steady state whose Slurm queries are counted

           "results_dir": str(tmp_path / "results")}
    record = LocalRun.start(parse_config(raw), tmp_path, "hpcserve.testing.endpoint", RunKind.ENDPOINT,
                            choose_key("HPCSERVE_API_KEY", False), {MEMBER_ENV: "1"}).record
    state = lambda: read_json(RunPaths(Path(record.run_dir)).state, {}) or {}  # noqa: E731
    queries = lambda: (state().get("control") or {}).get("slurm_queries") or 0  # noqa: E731
    try:
        wait_until(lambda: state().get("status") in ("ready", "failed"), 240, "the endpoint's ready")
        assert state()["status"] == "ready", state().get("error")
        first = {m["name"]: m["record"]["job_id"] for m in state()["members"]}
        before, started = queries(), time.monotonic()
        out = tmp_path / "load.json"
        load = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "scale_load.py"), "--url",
                                 state()["endpoint"]["url"], "--rate", "20", "--duration-s", "100",
                                 "--key", env["HPCSERVE_API_KEY"], "--out", str(out)])
        time.sleep(10)
        window = time.monotonic() - started
        steady = queries() - before
        assert steady <= window / 5 + 1, f"{steady} squeue calls in {window:.0f} s for {MEMBERS} members"

        def handed_over() -> bool:
            members = {m["name"]: m for m in state()["members"]}
            return all(members[n]["status"] == "gone" and members[n].get("successor") for n in first)

        wait_until(handed_over, 150, "every member handed over to its successor", poll_s=1)
        load.wait(timeout=120)
        result = json.loads(out.read_text())
        assert result["failed"] == 0 and result["ok"] >= 1900, result["errors"]
        jobs = job_states("sb-scale", env)
        assert {jobs[j] for j in first.values()} <= {"COMPLETED", "CANCELLED"}, jobs  # drained, not TIMEOUT
        successors = [m for m in state()["members"] if m["role"] == "successor"]
        assert len(successors) >= MEMBERS
    finally:
        LocalRun(record).stop(timeout_s=120)
    wait_until(lambda: squeue_empty(env), 60, "no job left in the queue")
