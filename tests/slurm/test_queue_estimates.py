"""What Slurm 22.05 says about when a job would start, on outputs captured from the sandbox by
benchmarks/slurm_queue_estimates.py: `sbatch --test-only` (nothing queued) and squeue's expected start
of a pending job, as the walltime handover reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_client import FakeRunner, captured, reply

from hpcserve.core.errors import SlurmError
from hpcserve.slurm.client import SlurmClient
from hpcserve.slurm.parse import (
    SlurmParseError,
    parse_squeue,
    parse_test_only,
    slurm_epoch,
    time_limit_seconds,
)
from hpcserve.slurm.states import JobState

CAPTURED = Path(__file__).parent / "data" / "captured"


def text(name: str) -> str:
    return (CAPTURED / name).read_text()


def test_test_only_answers_when_and_where_on_stderr():
    idle = parse_test_only(text("sbatch-test-only-idle.stderr"))
    busy = parse_test_only(text("sbatch-test-only-busy.stderr"))
    assert idle.nodes and idle.partition == "debug" and idle.processors > 0
    # Every node held: the earliest start is when the first running job reaches its limit
    assert slurm_epoch(busy.start) > slurm_epoch(idle.start)
    assert (CAPTURED / "sbatch-test-only-busy.stdout").read_text() == ""  # stdout stays empty, even --parsable
    assert parse_test_only(text("sbatch-test-only-parsable.stderr")).start


def test_an_answer_without_an_estimate_is_an_error_quoting_it():
    with pytest.raises(SlurmParseError, match="sbatch: error: Batch job submission failed"):
        parse_test_only("sbatch: error: Batch job submission failed: Requested node configuration is not available")


def test_will_run_tests_the_script_and_reads_the_answer():
    runner = FakeRunner((["sbatch", "--test-only"], captured("sbatch-test-only-busy")))
    will_run = SlurmClient(runner=runner).will_run("#!/bin/bash\n#SBATCH --time=3\ntrue\n")
    assert will_run.start == parse_test_only(text("sbatch-test-only-busy.stderr")).start and runner.done()
    refused = FakeRunner((["sbatch", "--test-only"], captured("sbatch-bad-partition")))
    with pytest.raises(SlurmError):
        SlurmClient(runner=refused).will_run("#!/bin/bash\n")
    odd = FakeRunner((["sbatch", "--test-only"], reply(stderr="sbatch: wrapped by the site\n")))
    with pytest.raises(SlurmError, match="expected 'Job N to start at TIME"):
        SlurmClient(runner=odd).will_run("#!/bin/bash\n")


def test_a_pending_job_gets_its_expected_start_from_the_backfill_scheduler():
    fresh, = parse_squeue(text("squeue-pending-fresh.stdout"))
    estimated, = parse_squeue(text("squeue-pending-estimate.stdout"))
    assert fresh.state is JobState.PENDING and estimated.state is JobState.PENDING
    assert slurm_epoch(estimated.start_time) is not None


def test_times_and_limits_as_seconds():
    assert time_limit_seconds("4") == 240 and time_limit_seconds("1:00:00") == 3600
    assert time_limit_seconds("2-00:00:00") == 172800 and time_limit_seconds("UNLIMITED") is None
    assert slurm_epoch("Unknown") is None and slurm_epoch("N/A") is None and slurm_epoch(None) is None
    assert slurm_epoch("2026-12-02T05:00:00") - slurm_epoch("2026-12-02T04:59:00") == 60
