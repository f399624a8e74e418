"""A run folder's progress: state.json (what is running now) and timeline.json (a timestamp per stage).

    RunStateWriter(run_dir)   the one writer, inside the driver or the endpoint controller
    RunState.read(run_dir)    what `up`, `status`, the controller and tests read back, typed
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcserve.core.files import read_json, write_json
from hpcserve.core.paths import RunPaths
from hpcserve.core.statuses import RunStatus, StageEvent


class RunStateWriter:
    """Writes state.json and timeline.json of one run folder (atomically: readers never see half a file)."""

    def __init__(self, run_dir: Path, compact: bool = False):
        """compact: state.json on one line (an endpoint's, rewritten every second with every member)."""
        self.paths = RunPaths(run_dir)
        self.indent = None if compact else 2
        self.run_dir = self.paths.root
        self.timeline: list[dict[str, Any]] = read_json(self.paths.timeline, []) or []
        self.state: dict[str, Any] = read_json(self.paths.state, {}) or {}

    def begin(self, stage: str, detail: str = "") -> None:
        self._event(stage, StageEvent.STARTED, detail)
        self.update(stage=stage, status=RunStatus.STARTING)

    def done(self, stage: str, detail: str = "") -> None:
        self._event(stage, StageEvent.DONE, detail)

    def fail(self, stage: str, diagnosis: str, log: str | None) -> None:
        self._event(stage, StageEvent.FAILED, diagnosis)
        self.update(stage=stage, status=RunStatus.FAILED, error={"stage": stage, "diagnosis": diagnosis, "log": log})

    def add(self, event: dict[str, Any]) -> None:
        """An event that happened elsewhere (a member's stage, forwarded by the endpoint)."""
        self.timeline.append(event)
        write_json(self.paths.timeline, self.timeline)

    def update(self, **fields: Any) -> None:
        self.state.update(fields, updated=time.time())
        write_json(self.paths.state, self.state, self.indent)

    @property
    def status(self) -> RunStatus | None:
        status = self.state.get("status")
        return RunStatus(status) if status else None

    def _event(self, stage: str, event: str, detail: str) -> None:
        self.timeline.append({"stage": stage, "event": event, "time": time.time(), "detail": detail})
        write_json(self.paths.timeline, self.timeline)


@dataclass(frozen=True)
class StageFailure:
    stage: str
    diagnosis: str
    log: str | None = None

    @classmethod
    def from_dict(cls, data: dict) -> StageFailure:
        return cls(str(data.get("stage") or "?"), str(data.get("diagnosis") or "?"), data.get("log"))

    def to_dict(self) -> dict:
        return {"stage": self.stage, "diagnosis": self.diagnosis, "log": self.log}


@dataclass(frozen=True)
class Decision:
    """One decision of an endpoint's controller, with its reason."""

    time: float
    action: str
    reason: str

    def to_dict(self) -> dict:
        return {"time": self.time, "action": self.action, "reason": self.reason}


@dataclass
class RunState:
    """state.json, typed. Replicas and members stay dicts of their writers' shape (engine.replicas'
    Replica.describe, endpoint.control.members' Member.to_json)."""

    status: RunStatus = RunStatus.SUBMITTED
    stage: str | None = None
    error: StageFailure | None = None
    replicas: list[dict] = field(default_factory=list)
    endpoint_url: str | None = None  # the router's URL (endpoint runs)
    router_pid: int | None = None
    members: list[dict] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    ready_answers: dict[str, str] = field(default_factory=dict)  # the real completion(s) `up` waited for
    job_started: float | None = None
    driver_pid: int | None = None
    ray_gcs: str | None = None
    updated: float | None = None
    sleep: dict | None = None  # a model that sleeps when idle: its wake as the controller last told it (protocol.Waking)
    swap: list[dict] = field(default_factory=list)  # a member's engines of swap.models: {"model", "url"}, asleep
    swapped: dict = field(default_factory=dict)  # an endpoint's swap: member -> {"awake": [...], "asleep": [...]}

    @classmethod
    def read(cls, run_dir: Path | str) -> RunState:
        return cls.from_dict(read_json(RunPaths(Path(run_dir)).state, {}) or {})

    @classmethod
    def from_dict(cls, data: dict) -> RunState:
        endpoint = data.get("endpoint") or {}
        return cls(status=RunStatus(data.get("status") or RunStatus.SUBMITTED), stage=data.get("stage"),
                   error=StageFailure.from_dict(data["error"]) if data.get("error") else None,
                   replicas=list(data.get("replicas") or []), endpoint_url=endpoint.get("url"),
                   router_pid=endpoint.get("pid"), members=list(data.get("members") or []),
                   decisions=[Decision(d["time"], d["action"], d["reason"]) for d in data.get("decisions") or []],
                   ready_answers=dict((data.get("ready_check") or {}).get("answers") or {}),
                   job_started=data.get("job_started"), driver_pid=data.get("driver_pid"),
                   ray_gcs=(data.get("ray") or {}).get("gcs"), updated=data.get("updated"), sleep=data.get("sleep"),
                   swap=list(data.get("swap") or []), swapped=dict(data.get("swapped") or {}))

    @property
    def first_answer(self) -> str | None:
        return next(iter(self.ready_answers.values()), None)


def read_timeline(run_dir: Path | str) -> list[dict]:
    return read_json(RunPaths(Path(run_dir)).timeline, []) or []
