"""What Slurm says about a job, as an enum and a frozen dataclass. Pure: no Slurm calls here."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class JobState(str, Enum):
    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    SUSPENDED = "SUSPENDED"
    REQUEUED = "REQUEUED"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, text: str) -> JobState:
        """A state as squeue %T, scontrol JobState= or sacct State print it.

        sacct adds detail ("CANCELLED by 1000", "CANCELLED+"); rare states fold into the nearest
        one above; anything else is UNKNOWN rather than a guess.
        """
        word = text.strip().split(" ", 1)[0].rstrip("+").upper()
        if word in cls.__members__:
            return cls[word]
        return _RARE_STATES.get(word, cls.UNKNOWN)

    @property
    def finished(self) -> bool:
        """The job has ended for good: its state will not change again."""
        return self in _FINISHED

    @property
    def active(self) -> bool:
        """The job is queued, holds nodes, or will be queued again."""
        return self in _ACTIVE


_FINISHED = frozenset({
    JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT, JobState.NODE_FAIL,
    JobState.OUT_OF_MEMORY, JobState.PREEMPTED, JobState.BOOT_FAIL, JobState.DEADLINE,
})
_ACTIVE = frozenset({
    JobState.PENDING, JobState.CONFIGURING, JobState.RUNNING, JobState.COMPLETING,
    JobState.SUSPENDED, JobState.REQUEUED,
})
# States Slurm has that hpcserve does not tell apart (squeue(1) "JOB STATE CODES").
_RARE_STATES = {
    "REQUEUE_HOLD": JobState.REQUEUED,
    "REQUEUE_FED": JobState.REQUEUED,
    "RESV_DEL_HOLD": JobState.PENDING,
    "STOPPED": JobState.SUSPENDED,
    "SIGNALING": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "STAGE_OUT": JobState.COMPLETING,
    "SPECIAL_EXIT": JobState.FAILED,
    "REVOKED": JobState.CANCELLED,
}


@dataclass(frozen=True)
class JobInfo:
    """One job as Slurm reported it. Text fields keep Slurm's spelling; "unknown" values are None.

    exit_code is Slurm's "EXIT:SIGNAL" pair ("3:0" = exit code 3, "0:15" = killed by SIGTERM);
    squeue does not report it. node_list_raw is the compressed form ("hsn[1-3]"), nodes its expansion.
    time_limit is H:MM:SS / D-HH:MM:SS, or "UNLIMITED". source names the command that answered.
    """

    job_id: str
    state: JobState
    reason: str | None = None
    exit_code: str | None = None
    nodes: list[str] = field(default_factory=list)
    node_list_raw: str = ""
    start_time: str | None = None
    end_time: str | None = None
    time_limit: str | None = None
    name: str = ""
    source: str = ""
    preempt_time: str | None = None  # when Slurm preempted it (scontrol's PreemptTime; squeue does not say)

    def describe(self) -> str:
        """One line a user can act on, e.g. "PENDING (Resources)", "FAILED, exit code 1:0"."""
        describer = _DESCRIBERS.get(self.state, _describe_generic)
        return describer(self)


def _describe_pending(info: JobInfo) -> str:
    return f"PENDING ({info.reason})" if info.reason else "PENDING"


def _describe_running(info: JobInfo) -> str:
    where = f" on {info.node_list_raw}" if info.node_list_raw else ""
    since = f" since {info.start_time}" if info.start_time else ""
    return f"{info.state.value}{where}{since}"


def _describe_exit(info: JobInfo) -> str:
    text = info.state.value
    # NonZeroExitCode only repeats the exit code; other reasons (BadConstraints, ...) say why.
    if info.reason and info.reason != "NonZeroExitCode":
        text += f" ({info.reason})"
    if info.exit_code:
        text += f", exit code {info.exit_code}"
    return text


def _describe_timeout(info: JobInfo) -> str:
    limit = info.time_limit or "its"
    return f"TIMEOUT after {limit} time limit"


def _describe_node_fail(info: JobInfo) -> str:
    # Slurm does not say which of the job's nodes failed; name them all.
    return f"NODE_FAIL on {info.node_list_raw}" if info.node_list_raw else "NODE_FAIL"


def _describe_cancelled(info: JobInfo) -> str:
    # The Reason of a cancelled job is stale (e.g. "Priority" for one cancelled while pending).
    if not info.node_list_raw:
        return "CANCELLED before it started"
    return f"CANCELLED while on {info.node_list_raw}"


def _describe_generic(info: JobInfo) -> str:
    text = info.state.value
    if info.reason:
        text += f" ({info.reason})"
    if info.state.finished and info.exit_code:
        text += f", exit code {info.exit_code}"
    return text


_DESCRIBERS = {
    JobState.PENDING: _describe_pending,
    JobState.CONFIGURING: _describe_running,
    JobState.RUNNING: _describe_running,
    JobState.COMPLETING: _describe_running,
    JobState.COMPLETED: _describe_exit,
    JobState.FAILED: _describe_exit,
    JobState.OUT_OF_MEMORY: _describe_exit,
    JobState.TIMEOUT: _describe_timeout,
    JobState.NODE_FAIL: _describe_node_fail,
    JobState.CANCELLED: _describe_cancelled,
}

