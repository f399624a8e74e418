"""A deployment's progress, as files in its run folder: timeline.json (a timestamp per stage) and
state.json (what is running now). Written by the driver, read by `up`, `status` and tests.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hpcserve.core.state import STATE_FILE, TIMELINE_FILE, read_json, write_json

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

    def add(self, event: dict[str, Any]) -> None:
        """An event that happened elsewhere (a member's stage, forwarded by the endpoint)."""
        self.timeline.append(event)
        write_json(self.run_dir / TIMELINE_FILE, self.timeline)

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


def stage_breakdown(timeline: list[dict[str, Any]], submitted: float, job_started: float | None = None
                    ) -> dict[str, dict[str, float | None]]:
    """Where `up`'s time went, from the submission on: per stage its start (seconds after submission)
    and duration (None while it runs). 'queue' is the wait for the job (Slurm) or the driver to start.
    Stages may overlap: the engines load while the health check finishes. Pure."""
    out: dict[str, dict[str, float | None]] = {}
    if job_started is not None:
        out["queue"] = {"start_s": 0.0, "seconds": max(0.0, job_started - submitted)}
    for event in timeline:
        offset = event["time"] - submitted
        if event["event"] == "started":
            out[event["stage"]] = {"start_s": offset, "seconds": None}
        elif event["event"] in ("done", "failed") and event["stage"] in out:
            entry = out[event["stage"]]
            entry["seconds"] = offset - (entry["start_s"] or 0.0)
    return out


def breakdown_line(stages: dict[str, dict[str, float | None]]) -> str:
    """'queue 1.2 s · ray 8.0 s · health 2.6 s · engine 67.1 s (from +10.2 s)'. Pure."""
    parts = []
    for stage, span in stages.items():
        if stage == "ready":
            parts.append(f"ready at +{span['start_s']:.1f} s")
            continue
        took = "running" if span["seconds"] is None else f"{span['seconds']:.1f} s"
        parts.append(f"{stage} {took} (from +{span['start_s']:.1f} s)")
    return " · ".join(parts)
