"""A deployment's progress, as files in its run folder: timeline.json (a timestamp per stage) and
state.json (what is running now). Written by the driver, read by `up`, `status` and tests.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hpcserve.state import STATE_FILE, TIMELINE_FILE, read_json, write_json

STAGES = ("submitted", "ray", "health", "engine", "ready")


class Progress:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.timeline: list[dict[str, Any]] = read_json(self.run_dir / TIMELINE_FILE, []) or []
        self.state: dict[str, Any] = read_json(self.run_dir / STATE_FILE, {}) or {}

    def begin(self, stage: str, detail: str = "") -> None:
        self._event(stage, "started", detail)
        self.update(stage=stage, status="starting")

    def done(self, stage: str, detail: str = "") -> None:
        self._event(stage, "done", detail)

    def fail(self, stage: str, diagnosis: str, log: str | None) -> None:
        self._event(stage, "failed", diagnosis)
        self.update(stage=stage, status="failed", error={"stage": stage, "diagnosis": diagnosis, "log": log})

    def update(self, **fields: Any) -> None:
        self.state.update(fields, updated=time.time())
        write_json(self.run_dir / STATE_FILE, self.state)

    def _event(self, stage: str, event: str, detail: str) -> None:
        self.timeline.append({"stage": stage, "event": event, "time": time.time(), "detail": detail})
        write_json(self.run_dir / TIMELINE_FILE, self.timeline)


def stage_durations(timeline: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds each stage took, from its 'started' to its 'done' event. Pure."""
    started: dict[str, float] = {}
    durations: dict[str, float] = {}
    for event in timeline:
        if event["event"] == "started":
            started[event["stage"]] = event["time"]
        elif event["event"] == "done" and event["stage"] in started:
            durations[event["stage"]] = event["time"] - started[event["stage"]]
    return durations
