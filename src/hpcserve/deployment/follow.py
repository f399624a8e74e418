"""Following a deployment while it starts, from the command that started it (`up`, `adopt`, `check`): each
stage reported as its process writes it, until a final status, the end of its process or job, or a
deadline.

    follow(record, on_event, timeout_s)   -> UpResult: its status, replicas, endpoint, first answer,
                                             where the time went, or why it failed
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hpcserve.core.errors import StageError
from hpcserve.core.keys import key_source
from hpcserve.core.registry import Record
from hpcserve.core.runstate import RunState, read_timeline
from hpcserve.core.statuses import RunStatus, Stage, StageEvent
from hpcserve.core.timeline import stage_breakdown
from hpcserve.deployment.runs import run_of
from hpcserve.deployment.watch import StartWatch

FOLLOW_POLL_S = 0.3


@dataclass
class Event:
    stage: str
    event: str
    detail: str
    time: float


@dataclass
class UpResult:
    name: str
    run_dir: Path
    status: RunStatus
    replicas: list[dict] = field(default_factory=list)
    answer: str | None = None
    api_key_source: str | None = None
    seconds: float = 0.0
    reason: str | None = None  # why it failed when the driver could not say (its job or process ended)
    stages: dict = field(default_factory=dict)  # where the time went: timeline.stage_breakdown
    endpoint: str | None = None  # the router's URL, when there is one
    error: dict | None = None  # the failed stage, its diagnosis and the log to read
    adopted: list[dict] | None = None  # adopting: the new controller's decisions (None: a fresh start)


def follow(record: Record, on_event: Callable[[Event], None] | None, timeout_s: float,
           seen_events: int = 0) -> UpResult:
    """Report each stage as the driver writes it, until a final status or the deadline. seen_events:
    timeline events already there (an adopted endpoint's), not reported again."""
    watch = StartWatch(record, check_every_s=2.0, seen=seen_events)
    deadline = time.monotonic() + timeout_s
    report = on_event or (lambda event: None)
    while True:
        for item in watch.new_events():
            report(Event(item["stage"], item["event"], item.get("detail", ""), item["time"]))
        seen = watch.observe()
        fresh = written_by(record, seen.state)
        if seen.state.status.final and fresh:
            return up_result(record, seen.state)
        if seen.queue and seen.queue.startswith("PENDING"):  # users otherwise stare at nothing
            report(Event(Stage.QUEUE, StageEvent.WAITING, seen.queue, time.time()))
        gone = seen.gone if fresh else run_of(record).gone()  # the watch skips a run whose file looks final
        if gone:
            report(Event(Stage.DRIVER, StageEvent.FAILED, gone, time.time()))
            return UpResult(record.name, Path(record.run_dir), RunStatus.FAILED, reason=gone)
        if time.monotonic() > deadline:
            where = f" (job {record.job_id}: {watch.queue})" if watch.queue else ""
            raise StageError(seen.state.stage or Stage.SUBMITTED, f"not ready after {timeout_s:.0f} s{where}",
                             str(run_of(record).log))
        time.sleep(FOLLOW_POLL_S)


def written_by(record: Record, state: RunState) -> bool:
    """state.json is this process's word, not what a predecessor in the same run folder wrote last."""
    return not record.driver_pid or state.driver_pid in (None, record.driver_pid)


def up_result(record: Record, state: RunState) -> UpResult:
    """What the run's final state.json says, with where the time went."""
    timeline = read_timeline(record.run_dir)
    return UpResult(record.name, Path(record.run_dir), state.status, state.replicas, state.first_answer,
                    key_source(record.run_dir),
                    stages=stage_breakdown(timeline, record.created, state.job_started),
                    endpoint=state.endpoint_url, error=state.error.to_dict() if state.error else None)
