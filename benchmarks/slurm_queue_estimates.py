"""What Slurm 22.05 says about when a queued job will start, against when it did.

On the sandbox (3 nodes): blockers fill every node (one with a 2-minute limit, two with 6), then a
waiting job is estimated and submitted three ways:

    sbatch --test-only     the scheduler's will-run test, nothing queued
    squeue %S              the expected start of a pending job (set by the backfill scheduler)
    --begin=now+60         eligible only from then: waits in the queue without holding nodes
    --dependency=after:J+1 eligible one minute after job J started

Every raw output is saved (tests/slurm/data/captured/, the parsers' tests read them) and the estimates
over time with the actual start go to a JSON file. Run as root, holding the heavy lock:

    flock /tmp/hpcserve-heavy.lock python benchmarks/slurm_queue_estimates.py OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from hpcserve.sandbox.cluster import ensure_sandbox
from hpcserve.slurm.parse import SQUEUE_FORMAT

CAPTURED = Path(__file__).resolve().parents[1] / "tests" / "slurm" / "data" / "captured"
POLL_S = 5.0
DEADLINE_S = 420.0


def run(argv: list[str], env: dict, capture: str | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    if capture:
        for suffix, text in (("stdout", done.stdout), ("stderr", done.stderr), ("rc", f"{done.returncode}\n")):
            (CAPTURED / f"{capture}.{suffix}").write_text(text)
    return done


def sbatch(env: dict, *options: str, capture: str | None = None) -> str:
    done = run(["sbatch", "--parsable", "--no-requeue", "-o", "/dev/null", *options], env, capture)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def squeue(env: dict, jobs: list[str], *extra: str, capture: str | None = None) -> dict[str, list[str]]:
    done = run(["squeue", "--noheader", "--states=all", f"--jobs={','.join(jobs)}", f"--format={SQUEUE_FORMAT}",
                *extra], env, capture)
    return {line.split("|")[0]: line.split("|") for line in done.stdout.splitlines() if line.strip()}


def main(out: Path) -> None:
    sandbox = ensure_sandbox(nodes=3)
    env = {**os.environ, **sandbox.env()}
    test_only = ["sbatch", "--test-only", "--exclusive", "--time=3", "-J", "qe-probe", "--wrap", "true"]
    record: dict = {"started": datetime.now().isoformat(timespec="seconds"), "samples": []}
    record["idle_test_only"] = run(test_only, env, "sbatch-test-only-idle").stderr.strip()
    blockers = [sbatch(env, "--exclusive", f"--time={limit}", "-J", f"qe-block{index}", "--wrap", "sleep 900")
                for index, limit in enumerate((2, 6, 6))]
    waiting: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while any(row[1] != "RUNNING" for row in squeue(env, blockers).values()):
            assert time.monotonic() < deadline, squeue(env, blockers)
            time.sleep(1)
        record["blockers"] = {j: squeue(env, [j])[j] for j in blockers}
        record["busy_test_only"] = run(test_only, env, "sbatch-test-only-busy").stderr.strip()
        run(["sbatch", "--test-only", "--parsable", *test_only[2:]], env, "sbatch-test-only-parsable")
        job = sbatch(env, "--exclusive", "--time=3", "-J", "qe-wait", "--wrap", "sleep 20")
        begin = sbatch(env, "--exclusive", "--time=1", "--begin=now+60", "-J", "qe-begin", "--wrap", "sleep 5")
        after = sbatch(env, "--exclusive", "--time=1", f"--dependency=after:{blockers[1]}+1", "-J", "qe-after",
                       "--wrap", "sleep 5")
        waiting = [job, begin, after]
        record["jobs"] = {"wait": job, "begin": begin, "after": after}
        run(["squeue", "--noheader", f"--jobs={job}", f"--format={SQUEUE_FORMAT}"], env, "squeue-pending-fresh")
        run(["scontrol", "show", "job", "-o", begin], env, "scontrol-pending-begin")
        captured_estimate = False
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            rows = squeue(env, waiting)
            sample = {"time": datetime.now().isoformat(timespec="seconds"),
                      "squeue": {j: rows.get(j) for j in waiting},
                      "test_only": run(test_only, env).stderr.strip()}
            record["samples"].append(sample)
            print(json.dumps(sample), flush=True)
            pending = rows.get(job)
            if pending and pending[1] == "PENDING" and pending[4] not in ("N/A", "") and not captured_estimate:
                squeue(env, [job], capture="squeue-pending-estimate")
                run(["squeue", "--start", "--noheader", f"--jobs={job}"], env, "squeue-start-default")
                run(["scontrol", "show", "job", "-o", job], env, "scontrol-pending-estimate")
                captured_estimate = True
            if all(rows.get(j) and rows[j][1] not in ("PENDING",) for j in waiting):
                break
            time.sleep(POLL_S)
        record["final"] = {j: squeue(env, [j]).get(j) for j in [*blockers, *waiting]}
    finally:
        run(["scancel", *blockers, *waiting], env)
    out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
