"""A walltime too short for the walltime handover is refused before anything starts: by `up`
(one message, exit 2, nothing started) and by the doctor (a blocker with its fix), from the startup
measured in the deployment's last run or estimated from the weights, and Slurm's queue estimate."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from helpers import run_cli

from hpcserve.core.config import parse_config
from hpcserve.deployment.preflight import check_walltime, walltime_check
from hpcserve.doctor.checks import Captured, check_time
from hpcserve.doctor.findings import Severity
from hpcserve.endpoint.control.policies.handover import Handover
from hpcserve.planning.walltime import WalltimeCheck, handover_lead_s, slurm_time_text
from hpcserve.slurm.parse import WillRun

CAPTURED = Path(__file__).parents[1] / "slurm" / "data" / "captured"


def config(time: str, router: bool = True, scheduler: str = "slurm", **serve):
    return parse_config({"name": "w", "model": {"path": "org/m"}, "serve": {"router": router, **serve},
                         "cluster": {"scheduler": scheduler, "time": time}})


def test_a_job_must_serve_alone_a_quarter_of_its_time():
    assert handover_lead_s(0, 212) == 378
    check = WalltimeCheck(240, 212, 0, "measured under load: m1 212 s", "no estimate")
    assert not check.enough and check.serving_s < 0
    assert check.walltime_that_works_s == 540  # 378 / 0.75 = 504 s: 9 minutes
    message = check.problem("cluster.time")
    assert message.startswith("cluster.time = 4 min is too short for walltime handovers")
    assert "1.5 x startup ~212 s (measured under load: m1 212 s) + 60 s" in message
    assert message.endswith("Set cluster.time to at least 0:09:00")
    assert WalltimeCheck(540, 212, 0, "", "").enough and WalltimeCheck(540, 212, 0, "", "").problem("t") is None
    queued = WalltimeCheck(3600, 100, 2700, "estimated", "Slurm expects ...")
    assert not queued.enough and "queue ~2700 s (Slurm expects ...)" in queued.problem("cluster.time")
    assert slurm_time_text(3660) == "1:01:00"


def test_preflight_estimates_before_any_measurement_and_counts_slurms_queue():
    before = walltime_check(config("4"), "org/m", None, now=0.0)
    assert before.startup_s == 120 and "estimated before any measurement" in before.startup_basis
    assert not before.enough  # 1.5 x 120 + 60 = 240 s of lead in a 240 s job
    assert walltime_check(config("6"), "org/m", None, now=0.0).enough
    now = datetime(2026, 12, 2, 5, 0, 0)
    queued = walltime_check(config("60"), "org/m", WillRun("9", (now + timedelta(minutes=45)).isoformat(), 4, ["n1"],
                                                            "debug"), now.timestamp())
    assert queued.queue_s == 2700 and not queued.enough
    measured = walltime_check(config("6"), "org/m", None, 0.0, (212.0, "measured under load: m1 212 s"))
    assert not measured.enough and measured.walltime_that_works_s == 540
    with pytest.raises(Exception, match="at least 0:09:00"):
        check_walltime(measured, "w.yaml")
    for unchecked in (config("4", router=False), config("UNLIMITED"), config("4", scheduler="local")):
        assert walltime_check(unchecked, "org/m", None, 0.0) is None
    check_walltime(None, "w.yaml")


def test_a_startup_measured_on_the_users_cluster_replaces_the_estimate_until_this_deployment_measures_one():
    stated = config("4", startup_s=45)
    check = walltime_check(stated, "org/m", None, now=0.0)
    assert (check.startup_s, check.startup_basis) == (45, "serve.startup_s")
    assert check.enough  # 1.5 x 45 + 60 = 128 s of lead in a 240 s job
    assert walltime_check(stated, "org/m", None, 0.0, (212.0, "measured under load: m1 212 s")).startup_s == 212
    assert {f.severity for f in check_time(stated, None)} == {Severity.WARNING}  # serves, if under 10 minutes
    assert Handover(stated).startup_estimate.basis == "serve.startup_s"
    assert Handover(config("4")).startup_estimate.seconds == 120


def test_doctor_blocks_with_the_walltime_that_works_and_reads_slurms_queue_estimate():
    [blocked] = check_time(config("4"), None)
    assert blocked.severity is Severity.BLOCKER and "too short for walltime handovers" in blocked.what
    assert blocked.fix == "set cluster.time to at least 0:12:00"  # also 10 minutes of serving after the load
    answer = (CAPTURED / "sbatch-test-only-busy.stderr").read_text()
    start = datetime.fromisoformat(answer.split(" to start at ")[1].split()[0])
    test_only = Captured(("sbatch", "--test-only"), 0, "", answer)
    [queued] = check_time(config("20"), None, test_only, (start - timedelta(minutes=30)).timestamp())
    assert queued.severity is Severity.BLOCKER and "queue ~1800 s (Slurm's estimate, sbatch --test-only)" in queued.what
    assert {f.severity for f in check_time(config("20"), None, test_only, start.timestamp())} == {Severity.OK}
    assert check_time(config("4", router=False), None)[0].what.startswith("cluster.time = 4 leaves under 10 min")


def fake_sbatch(folder: Path, wait_min: int) -> dict[str, str]:
    """An sbatch on PATH that answers --test-only like Slurm 22.05 (a start wait_min from now) and refuses
    anything else: `up` must start nothing."""
    folder.mkdir()
    script = folder / "sbatch"
    script.write_text("#!/bin/sh\n"
                      'if [ "$1" = "--test-only" ]; then\n'
                      f'  echo "sbatch: Job 77 to start at $(date -d \'+{wait_min} min\' +%Y-%m-%dT%H:%M:%S) '
                      'using 1 processors on nodes hsn1 in partition debug" >&2; exit 0\nfi\n'
                      'echo "sbatch: error: this test submits nothing" >&2; exit 1\n')
    script.chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}"}


def sandbox_config(path: Path, time: str) -> Path:
    path.write_text(f"name: wall\nmodel: {{path: 'builtin:tiny-llama', served_name: tiny}}\n"
                    f"cluster: {{scheduler: slurm, time: '{time}', cpus_per_node: 1}}\n"
                    f"results_dir: {path.parent / 'results'}\n")
    return path


def refused(result, tmp_path: Path) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error:") and result.stderr.count("error:") == 1, result.stderr
    assert "Traceback" not in result.stderr
    logs = tmp_path / "results" / "logs"
    assert not logs.exists() or not any(p for p in logs.iterdir() if not p.name.startswith("wall-endpoint-0"))
    return " ".join(result.stderr.split())


def test_up_refuses_a_walltime_the_handover_cannot_work_with(tmp_path, hpcserve_home):
    env = fake_sbatch(tmp_path / "bin", wait_min=30)
    message = refused(run_cli("up", str(sandbox_config(tmp_path / "wall.yaml", "20")), env=env, timeout=120), tmp_path)
    assert "cluster.time = 20 min is too short for walltime handovers" in message
    assert "queue ~" in message and "Slurm expects a member's job to start at" in message
    assert "estimated before any measurement" in message and "at least 0:46:00" in message

    # The startup measured in this deployment's last run counts: 212 s under load
    last = tmp_path / "results" / "logs" / "wall-endpoint-00000000-000000"
    last.mkdir(parents=True)
    member = {"name": "wall-m1", "slot": 0, "role": "successor", "layout": {}, "record": {"run_dir": "/x"},
              "launched": 1000.0, "ready_s": 215.0, "startup_s": 212.0, "under_load": True}
    (last / "state.json").write_text(json.dumps({"status": "stopped", "members": [member]}))
    env = fake_sbatch(tmp_path / "bin2", wait_min=0)
    message = refused(run_cli("up", str(sandbox_config(tmp_path / "wall.yaml", "6")), env=env, timeout=120), tmp_path)
    assert "startup ~212 s (measured under load: wall-m1 212 s, in the last run wall-endpoint-0" in message
    assert "at least 0:09:00" in message
