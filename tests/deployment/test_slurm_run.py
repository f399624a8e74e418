"""A deployment's Slurm job goes through the client it is given (SlurmRun): submitted held, its folder
filled, then released; cancelled when it cannot be prepared; stopped with TERM to the batch shell. The
real sbatch path is exercised by the sandbox tests (tests/cluster/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcserve.core.config import load_config
from hpcserve.core.errors import SlurmError
from hpcserve.core.keys import GENERATED, ApiKey, new_key
from hpcserve.deployment.runs import launch, run_of
from hpcserve.slurm.client import SCRIPT_NAME, SlurmClient
from hpcserve.slurm.states import JobInfo, JobState

EXAMPLE = Path(__file__).parents[2] / "examples" / "slurm-llama-70b.yaml"
KEY = ApiKey(new_key(), GENERATED)


class RecordingSlurm(SlurmClient):
    """Answers as a cluster would and records what it was asked, in order."""

    def __init__(self, job_id: str = "77", state: JobState = JobState.RUNNING, release_fails: bool = False):
        super().__init__()
        self.job_id, self.state, self.release_fails = job_id, state, release_fails
        self.calls: list[tuple] = []

    def submit(self, script_text: str, workdir: Path, hold: bool = False) -> str:
        self.calls.append(("submit", hold))
        (workdir / SCRIPT_NAME).write_text(script_text)  # where sbatch found it
        return self.job_id

    def release(self, job_id: str) -> None:
        self.calls.append(("release", job_id))
        if self.release_fails:
            raise SlurmError(["scontrol", "release", job_id], 1, "scontrol: error: Access/permission denied")

    def cancel(self, job_id: str, signal: str | None = None, batch_only: bool = False) -> None:
        self.calls.append(("cancel", job_id, signal, batch_only))
        self.state = JobState.CANCELLED

    def job(self, job_id: str) -> JobInfo:
        self.calls.append(("job", job_id))
        return JobInfo(job_id, self.state)

    def wait_for(self, job_id, predicate, timeout, poll=2.0, max_poll=15.0):
        return self.job(job_id)


def test_a_job_is_submitted_held_and_released_through_the_given_client(tmp_path):
    slurm = RecordingSlurm()
    record = launch(load_config(EXAMPLE), tmp_path, KEY, slurm=slurm)
    assert slurm.calls == [("submit", True), ("release", "77")]
    assert record.job_id == "77" and (Path(record.run_dir) / "config.yaml").is_file()


def test_a_job_that_cannot_be_prepared_is_cancelled_and_leaves_no_folder(tmp_path):
    slurm = RecordingSlurm(release_fails=True)
    with pytest.raises(SlurmError):
        launch(load_config(EXAMPLE), tmp_path, KEY, slurm=slurm)
    assert slurm.calls[-1] == ("cancel", "77", None, False)
    assert not [p for p in (tmp_path / "logs").iterdir() if p.name.startswith(".submit-")]


def test_a_running_job_is_stopped_by_term_to_its_batch_shell_through_the_given_client(tmp_path):
    slurm = RecordingSlurm()
    record = launch(load_config(EXAMPLE), tmp_path, KEY, slurm=slurm)
    assert run_of(record, slurm=slurm).stop(timeout_s=1) == []
    assert ("cancel", "77", "TERM", True) in slurm.calls
