"""Preemption on the sandbox, seen through hpcserve's Slurm client: a job in the `high` partition takes
the nodes of `scavenger` jobs (slurm.conf: PreemptType=preempt/partition_prio, PreemptMode=REQUEUE,
GraceTime on scavenger; hpcserve.sandbox.slurmfiles.PARTITIONS).

Runs against the session's sandbox before test_sandbox.py (file order within tests/sandbox/), whose
last test takes the cluster down; it leaves every node idle, as that file's first test expects.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hpcserve.sandbox.cluster import Sandbox, wait_for
from hpcserve.sandbox.slurmfiles import PREEMPT_GRACE_S
from hpcserve.slurm.client import SlurmClient, run_subprocess
from hpcserve.slurm.parse import parse_scontrol_fields
from hpcserve.slurm.states import JobInfo, JobState

pytestmark = pytest.mark.sandbox

# slurmctld ends a grace time on its next backfill pass or time-limit check (every 30 s in 22.05): a
# preempted job leaves its nodes GraceTime to GraceTime + 30 s after its SIGTERM.
PREEMPTED_WITHIN_S = PREEMPT_GRACE_S + 30 + 15

# --signal=B:TERM: with SlurmctldParameters=preempt_send_user_signal the batch script itself gets
# SIGTERM when preemption starts (without it only job steps would). The kill at the grace time's end
# brings a second SIGTERM (then SIGKILL after KillWait): the script leaves then.
SCAVENGER_JOB = """\
#!/bin/bash
#SBATCH --partition=scavenger
#SBATCH {requeue}
#SBATCH --signal=B:TERM@600
#SBATCH --exclusive
#SBATCH --nodes={nodes}
#SBATCH --output={folder}/slurm-%j.out
trap 'echo "TERM $(date +%s.%N)" >> {marker}; [ "$(grep -c TERM {marker})" -ge 2 ] && exit 143' TERM
echo "START $(date +%s.%N) restarts=${{SLURM_RESTART_COUNT:-0}}" >> {marker}
while true; do sleep 1 & wait $!; done
"""

HIGH_JOB = """\
#!/bin/bash
#SBATCH --partition=high
#SBATCH --exclusive
#SBATCH --nodes={nodes}
#SBATCH --output={folder}/slurm-%j.out
sleep 300
"""


@pytest.fixture
def client(sandbox: Sandbox, monkeypatch) -> SlurmClient:
    monkeypatch.setenv("SLURM_CONF", str(sandbox.slurm_conf))  # the client's runner passes it on
    return SlurmClient()


@pytest.fixture
def jobs(sandbox: Sandbox, client: SlurmClient):
    """Job ids to cancel at the end; then every node must be idle again (test_sandbox.py's first test)."""
    ids: list[str] = []
    yield ids
    for job_id in ids:
        client.cancel(job_id)
    # The backfill pass that ends a grace time marks the freed nodes PLANNED (sinfo: "planned") for
    # the high job; its next pass, bf_interval (5 s on the sandbox) later, clears that.
    idle = wait_for(lambda: all(sandbox.node_state(n) == "idle" for n in sandbox.node_names()), 45)
    assert idle, {n: sandbox.node_state(n) for n in sandbox.node_names()}


def changes_until(client: SlurmClient, job_id: str, done, timeout_s: float) -> list[tuple[float, JobInfo]]:
    """Every (state, reason) the client sees the job in, with the time first seen, until done(info)
    holds or the job has finished (client.wait_for raises JobWaitTimeout at the deadline)."""
    seen: list[tuple[float, JobInfo]] = []

    def note(info: JobInfo) -> bool:
        if not seen or (seen[-1][1].state, seen[-1][1].reason) != (info.state, info.reason):
            seen.append((time.time(), info))
        return done(info)

    client.wait_for(job_id, note, timeout_s, poll=0.2, max_poll=0.5)
    return seen


def marks(marker: Path, word: str) -> list[float]:
    lines = marker.read_text().splitlines() if marker.exists() else []
    return [float(line.split()[1]) for line in lines if line.startswith(word)]


def test_high_partition_preempts_scavenger_jobs_after_sigterm_and_grace(
        sandbox: Sandbox, client: SlurmClient, jobs: list[str], tmp_path: Path):
    nodes = sandbox.node_names()
    scavengers = {}  # name -> (job id, marker)
    for name, requeue, count in (("requeued", "--requeue", len(nodes) - 1), ("cancelled", "--no-requeue", 1)):
        folder, marker = tmp_path / name, tmp_path / f"{name}.marks"
        script = SCAVENGER_JOB.format(requeue=requeue, nodes=count, folder=folder, marker=marker)
        jobs.append(client.submit(script, folder))
        scavengers[name] = (jobs[-1], marker)
    for job_id, marker in scavengers.values():  # running, their TERM trap set: the cluster is full
        assert client.wait_for(job_id, lambda i: i.state is JobState.RUNNING, 30, poll=0.2).state is JobState.RUNNING
        assert wait_for(lambda m=marker: marks(m, "START"), 10), f"job {job_id} never started its script"

    high = client.submit(HIGH_JOB.format(nodes=len(nodes), folder=tmp_path / "high"), tmp_path / "high")
    jobs.append(high)

    # PreemptMode=REQUEUE: back to PENDING (held until BeginTime), its restart count up by one.
    requeued, requeued_marks = scavengers["requeued"]
    seen = changes_until(client, requeued, lambda i: i.state is JobState.PENDING, PREEMPTED_WITHIN_S)
    assert seen[-1][1].state is JobState.PENDING and seen[-1][1].reason == "BeginTime", seen
    # The restart count is not in JobInfo: read it with the client's runner and parser.
    fields = parse_scontrol_fields(run_subprocess(["scontrol", "show", "job", "-o", requeued], 30).stdout)
    assert (fields["Restarts"], fields["Requeue"], fields["Partition"]) == ("1", "1", "scavenger"), fields
    # SIGTERM reached the batch script GraceTime before its job left the nodes (the client's first
    # sight of it not RUNNING), and the script did not run again.
    left_running = next(t for t, info in seen if info.state is not JobState.RUNNING)
    [term, *_] = marks(requeued_marks, "TERM")
    assert term <= left_running - (PREEMPT_GRACE_S - 1), (term, left_running, seen)
    assert len(marks(requeued_marks, "START")) == 1

    # Not requeueable (--no-requeue): Slurm cancels it instead, as PREEMPTED; its script got SIGTERM too.
    cancelled, cancelled_marks = scavengers["cancelled"]
    preempted = client.wait_for(cancelled, lambda i: i.state.finished, 15, poll=0.2)
    assert preempted.state is JobState.PREEMPTED, preempted.describe()
    assert marks(cancelled_marks, "TERM")[0] <= left_running - (PREEMPT_GRACE_S - 1)

    running = client.wait_for(high, lambda i: i.state is JobState.RUNNING, 15, poll=0.2, max_poll=0.5)
    assert running.state is JobState.RUNNING and set(running.nodes) == set(nodes), running.describe()
    print(f"requeued job seen as {[info.describe() for _, info in seen]}, restarts {fields['Restarts']}; "
          f"--no-requeue job {preempted.describe()}; high job {running.describe()}; "
          f"SIGTERM {left_running - term:.1f} s before the requeue was seen")
