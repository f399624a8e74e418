"""SlurmClient's logic with a fake runner that replays outputs saved from a real cluster.

The fake checks the exact sequence of commands, so these tests also pin down which Slurm
commands each method runs. The real sbatch path is exercised by the sandbox tests.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpcserve.core.errors import SlurmError, UsageError
from hpcserve.slurm.client import (
    JobWaitTimeout,
    SlurmClient,
    SlurmJobNotFound,
    log_folders,
)
from hpcserve.slurm.states import JobState

CAPTURED = Path(__file__).parent / "data" / "captured"


def captured(name: str) -> subprocess.CompletedProcess[str]:
    read = lambda suffix: (CAPTURED / f"{name}.{suffix}").read_text()  # noqa: E731
    return subprocess.CompletedProcess([], int(read("rc")), read("stdout"), read("stderr"))


def reply(stdout: str = "", stderr: str = "", returncode: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess([], returncode, stdout, stderr)


class FakeRunner:
    """Answers each call with the next scripted reply, after checking the command's first words."""

    def __init__(self, *script: tuple[list[str], subprocess.CompletedProcess[str] | Exception]):
        self.script = list(script)
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        self.calls.append((argv, timeout))
        assert self.script, f"unexpected call {argv}"
        prefix, answer = self.script.pop(0)
        assert argv[:len(prefix)] == prefix, f"expected {prefix}..., got {argv}"
        if isinstance(answer, Exception):
            raise answer
        return answer

    def done(self) -> bool:
        return not self.script


class FakeClock:
    def __init__(self):
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


SQUEUE = ["squeue", "--noheader", "--states=all"]
SCONTROL = ["scontrol", "show", "job", "-o"]


# ---------------------------------------------------------------- submit

def test_submit_writes_the_script_and_returns_the_job_id(tmp_path):
    runner = FakeRunner((["sbatch", "--parsable"], captured("sbatch-failed")))
    script = f"#!/bin/bash\n#SBATCH --output={tmp_path}/results/logs/.slurm-%j.out\nexit 3\n"
    job_id = SlurmClient(runner=runner).submit(script, tmp_path / "work")
    assert job_id == "5"
    written = tmp_path / "work" / "job.sbatch"
    assert written.read_text() == script
    assert runner.calls == [(["sbatch", "--parsable", str(written)], 30.0)]
    assert (tmp_path / "results" / "logs").is_dir()   # Slurm would not create it


def test_a_held_submission_waits_for_its_release(tmp_path):
    """`up` submits held, puts the run folder (with the key) in place, then releases."""
    runner = FakeRunner((["sbatch", "--parsable", "--hold"], reply("41\n")), (["scontrol", "release", "41"], reply()))
    client = SlurmClient(runner=runner)
    assert client.submit("#!/bin/bash\n", tmp_path / "work", hold=True) == "41"
    client.release("41")
    assert [argv for argv, _ in runner.calls] == [["sbatch", "--parsable", "--hold", str(tmp_path / "work" / "job.sbatch")],
                                                  ["scontrol", "release", "41"]]


def test_submit_rejection_quotes_slurm_and_hints(tmp_path):
    runner = FakeRunner((["sbatch"], captured("sbatch-too-many-gpus")))
    with pytest.raises(SlurmError) as err:
        SlurmClient(runner=runner).submit("#!/bin/bash\n", tmp_path)
    assert err.value.returncode == 1
    assert "Requested node configuration is not available" in str(err.value)
    assert "gpus_per_node" in str(err.value)


def test_submit_with_unexpected_stdout_is_an_error(tmp_path):
    runner = FakeRunner((["sbatch"], reply("Submitted batch job 5\n")))
    with pytest.raises(SlurmError, match="Submitted batch job 5"):
        SlurmClient(runner=runner).submit("#!/bin/bash\n", tmp_path)


def test_submit_ignores_warnings_on_stderr_when_sbatch_succeeds(tmp_path):
    runner = FakeRunner((["sbatch"], reply("77\n", "sbatch: warning: can't honor --ntasks-per-node\n")))
    assert SlurmClient(runner=runner).submit("#!/bin/bash\n", tmp_path) == "77"


def test_log_folders_of_a_script():
    script = ("#!/bin/bash\n#SBATCH --output='/r/my logs/.slurm-%j.out'\n#SBATCH -e /r/err/%x.err\n"
              "#SBATCH --output=/r/%u/x.out\n")
    assert log_folders(script) == [Path("/r/my logs"), Path("/r/err")]


# ---------------------------------------------------------------- job

def test_job_that_is_queued_needs_only_squeue():
    runner = FakeRunner((SQUEUE, captured("squeue-job-running")))
    info = SlurmClient(runner=runner).job("2")
    assert info.state is JobState.RUNNING and info.source == "squeue"
    assert runner.calls[0][0] == SQUEUE + ["--jobs=2", "--format=%i|%T|%r|%N|%S|%e|%l|%j"]


def test_finished_job_gets_its_exit_code_from_scontrol():
    runner = FakeRunner((SQUEUE, captured("squeue-job-timeout")), (SCONTROL + ["1"], captured("scontrol-timeout")))
    info = SlurmClient(runner=runner).job("1")
    assert (info.state, info.exit_code, info.source) == (JobState.TIMEOUT, "0:15", "scontrol")
    assert info.describe() == "TIMEOUT after 00:01:00 time limit"


def test_job_that_left_the_controller_comes_from_the_completion_file():
    runner = FakeRunner(
        (SQUEUE, captured("squeue-unknown-job")),
        (SCONTROL, captured("scontrol-unknown-job")),
        (["sacct", "--parsable2"], captured("sacct-disabled")),
        (["sacct", "-c", "--parsable2"], captured("sacct-c-job")),
    )
    info = SlurmClient(runner=runner).job("5")
    assert info.describe() == "FAILED, exit code 3:0" and info.source == "sacct"
    assert runner.done()


def test_job_found_nowhere_is_a_clear_error():
    runner = FakeRunner(
        (SQUEUE, captured("squeue-unknown-job")),
        (SCONTROL, captured("scontrol-unknown-job")),
        (["sacct"], captured("sacct-disabled")),
        (["sacct", "-c"], captured("sacct-c-unknown-job")),
    )
    with pytest.raises(SlurmJobNotFound) as err:
        SlurmClient(runner=runner).job("99999")
    text = str(err.value)
    assert isinstance(err.value, SlurmError)
    assert text.startswith("Slurm job 99999 not found")
    assert "squeue: slurm_load_jobs error: Invalid job id specified" in text
    assert "sacct: Slurm accounting storage is disabled" in text
    assert "MinJobAge" in text


def test_unreachable_controller_is_not_mistaken_for_a_missing_job():
    runner = FakeRunner((SQUEUE, captured("squeue-controller-unreachable")))
    with pytest.raises(SlurmError) as err:
        SlurmClient(runner=runner).job("5")
    assert not isinstance(err.value, SlurmJobNotFound)
    assert "Unable to contact slurm controller" in str(err.value) and "scontrol ping" in str(err.value)


@pytest.mark.parametrize("bad", ["", "abc", "5; rm -rf /", "-1"])
def test_job_id_is_checked_before_any_command(bad):
    runner = FakeRunner()
    with pytest.raises(UsageError, match="not a Slurm job id"):
        SlurmClient(runner=runner).job(bad)
    assert runner.calls == []


# ---------------------------------------------------------------- running commands

def test_command_timeout_becomes_a_slurm_error():
    runner = FakeRunner((SQUEUE, subprocess.TimeoutExpired(["squeue"], 5, output=b"", stderr=b"partial")))
    with pytest.raises(SlurmError) as err:
        SlurmClient(runner=runner, timeout=5).job("5")
    assert err.value.returncode is None
    assert "timed out" in str(err.value) and "partial" in str(err.value) and "5 s" in str(err.value)
    assert runner.calls[0][1] == 5


def test_missing_slurm_commands_say_so():
    runner = FakeRunner((SQUEUE, FileNotFoundError("squeue")))
    with pytest.raises(SlurmError, match="command not found") as err:
        SlurmClient(runner=runner).job("5")
    assert err.value.returncode == 127 and "PATH" in str(err.value)


# ---------------------------------------------------------------- cancel

def test_cancel_and_signal_commands():
    runner = FakeRunner((["scancel"], captured("scancel-running")), (["scancel"], reply()))
    client = SlurmClient(runner=runner)
    client.cancel("2")
    client.cancel("3", signal="TERM")
    assert [argv for argv, _ in runner.calls] == [["scancel", "2"], ["scancel", "--signal=TERM", "--full", "3"]]


def test_cancelling_a_job_slurm_forgot_is_not_an_error():
    runner = FakeRunner((["scancel"], captured("scancel-signal-full")))
    SlurmClient(runner=runner).cancel("3", signal="TERM")
    assert runner.done()


def test_cancel_failure_for_other_reasons_raises():
    # scancel's own text when the controller is down was not captured; squeue's is the same message.
    runner = FakeRunner((["scancel"], captured("squeue-controller-unreachable")))
    with pytest.raises(SlurmError, match="Unable to contact slurm controller"):
        SlurmClient(runner=runner).cancel("3")


def test_cancel_refuses_a_bad_signal():
    with pytest.raises(UsageError, match="not a signal"):
        SlurmClient(runner=FakeRunner()).cancel("3", signal="TERM; reboot")


# ---------------------------------------------------------------- hostnames

def test_hostnames_from_slurm():
    runner = FakeRunner((["scontrol", "show", "hostnames", "a1,b[01-02],hsn[1-3,5]"], captured("scontrol-hostnames-mixed")))
    names = SlurmClient(runner=runner).hostnames("a1,b[01-02],hsn[1-3,5]")
    assert names == ["a1", "b01", "b02", "hsn1", "hsn2", "hsn3", "hsn5"]


def test_hostnames_invalid_list_raises_although_scontrol_exits_0():
    runner = FakeRunner((["scontrol", "show", "hostnames"], captured("hostnames-invalid")))
    with pytest.raises(SlurmError, match="Invalid hostlist"):
        SlurmClient(runner=runner).hostnames("x[01-03]-ib")


def test_hostnames_of_no_nodes_runs_nothing():
    runner = FakeRunner()
    assert SlurmClient(runner=runner).hostnames("") == []
    assert runner.calls == []


# ---------------------------------------------------------------- wait_for

def pending() -> subprocess.CompletedProcess[str]:
    return reply("6|PENDING|Resources||N/A|N/A|UNLIMITED|tb-pending\n")


def running() -> subprocess.CompletedProcess[str]:
    return reply("6|RUNNING|None|tbn[1-3]|2026-11-30T18:45:00|NONE|UNLIMITED|tb-pending\n")


def test_wait_for_polls_with_backoff_until_the_predicate_holds():
    clock = FakeClock()
    runner = FakeRunner((SQUEUE, pending()), (SQUEUE, pending()), (SQUEUE, pending()), (SQUEUE, running()))
    client = SlurmClient(runner=runner, clock=clock, sleep=clock.sleep)
    info = client.wait_for("6", lambda job: job.state is JobState.RUNNING, timeout=60, poll=2)
    assert info.nodes == ["tbn1", "tbn2", "tbn3"]
    assert clock.sleeps == [2, 3, 4.5]


def test_wait_for_stops_when_the_job_has_finished():
    clock = FakeClock()
    runner = FakeRunner((SQUEUE, captured("squeue-job-timeout")), (SCONTROL, captured("scontrol-timeout")))
    client = SlurmClient(runner=runner, clock=clock, sleep=clock.sleep)
    info = client.wait_for("1", lambda job: job.state is JobState.RUNNING, timeout=60)
    assert info.state is JobState.TIMEOUT and clock.sleeps == []


def test_wait_for_times_out_on_the_monotonic_deadline():
    clock = FakeClock()
    runner = FakeRunner(*[(SQUEUE, pending()) for _ in range(20)])
    client = SlurmClient(runner=runner, clock=clock, sleep=clock.sleep)
    with pytest.raises(JobWaitTimeout) as err:
        client.wait_for("6", lambda job: job.state is JobState.RUNNING, timeout=20, poll=2, max_poll=5)
    assert str(err.value) == "Slurm job 6 is still PENDING (Resources) after 20 s"
    assert err.value.info.reason == "Resources"
    assert sum(clock.sleeps) == pytest.approx(20) and max(clock.sleeps) <= 5
