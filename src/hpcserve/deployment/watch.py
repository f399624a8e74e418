"""Following a deployment that starts: the one watcher behind `hpcserve up` and the endpoint's launching
members. Its stages and status come from its run folder (read every call); its process or job is asked
about at most every `check_every_s` (sites rate-limit squeue), and while its job waits in the queue, the
queue's reason is reported once per change."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hpcserve.core.registry import Record
from hpcserve.core.runstate import RunState, read_timeline
from hpcserve.deployment.runs import Run, run_of


@dataclass(frozen=True)
class Observation:
    state: RunState
    gone: str | None = None  # why its process or job can no longer make progress (only when checked)
    queue: str | None = None  # the job's queue line, when it changed since the last observation


@dataclass
class StartWatch:
    record: Record
    check_every_s: float = 2.0
    seen: int = 0  # timeline events already handed out
    last_check: float = field(default=float("-inf"))
    queue: str | None = None  # the last queue line
    run_of: Callable[[Record], Run] = run_of  # an endpoint's: its members' jobs asked about together

    @property
    def run_dir(self) -> Path:
        return Path(self.record.run_dir)

    def new_events(self) -> list[dict]:
        """Timeline events since the last call."""
        timeline = read_timeline(self.run_dir)
        events, self.seen = timeline[self.seen:], len(timeline)
        return events

    def observe(self) -> Observation:
        state = RunState.read(self.run_dir)
        if state.status.final or state.status.ended or time.monotonic() - self.last_check < self.check_every_s:
            return Observation(state)
        self.last_check = time.monotonic()
        run = self.run_of(self.record)
        queue = None
        if self.record.job_id and not read_timeline(self.run_dir):  # started: its own stages tell the rest
            line = run.queue_line()
            if line is not None and line != self.queue:
                self.queue = queue = line
        gone = run.gone()
        if gone:
            state = RunState.read(self.run_dir)  # it may have written its last word just before it ended
        return Observation(state, gone, queue)
