"""Where a deployment's time went, from its timeline (core.runstate writes it). Pure."""

from __future__ import annotations

from typing import Any

from hpcserve.core.statuses import Stage, StageEvent


def stage_durations(timeline: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds each stage took, from its 'started' to its 'done' event. Pure."""
    started: dict[str, float] = {}
    durations: dict[str, float] = {}
    for event in timeline:
        if event["event"] == StageEvent.STARTED:
            started[event["stage"]] = event["time"]
        elif event["event"] == StageEvent.DONE and event["stage"] in started:
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
        if event["event"] == StageEvent.STARTED:
            out[event["stage"]] = {"start_s": offset, "seconds": None}
        elif event["event"] in (StageEvent.DONE, StageEvent.FAILED) and event["stage"] in out:
            entry = out[event["stage"]]
            entry["seconds"] = offset - (entry["start_s"] or 0.0)
    return out


def breakdown_line(stages: dict[str, dict[str, float | None]]) -> str:
    """'queue 1.2 s · ray 8.0 s · health 2.6 s · engine 67.1 s (from +10.2 s)'. Pure."""
    parts = []
    for stage, span in stages.items():
        if stage == Stage.READY:
            parts.append(f"ready at +{span['start_s']:.1f} s")
            continue
        took = "running" if span["seconds"] is None else f"{span['seconds']:.1f} s"
        parts.append(f"{stage} {took} (from +{span['start_s']:.1f} s)")
    return " · ".join(parts)
