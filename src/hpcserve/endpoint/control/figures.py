"""The control plane's own figures for state.json: how long its rounds and rotation steps take. Pure."""

from __future__ import annotations

RECENT_ROUNDS = 20  # the last rounds' durations, in state.json as they are


def control_figures(round_s: list[float], step_s: list[float], slurm_queries: int | None) -> dict:
    """The control plane's own figures for state.json: round and rotation-step times (ms), the last
    rounds as they were, and the Slurm queries made."""
    return {**percentiles_ms("round", round_s), **percentiles_ms("step", step_s),
            "round_ms_recent": [round(1000 * s, 2) for s in round_s[-RECENT_ROUNDS:]],
            "slurm_queries": slurm_queries}


def percentiles_ms(name: str, durations: list[float]) -> dict:
    ordered = sorted(durations)

    def at(q: float) -> float | None:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2) if ordered else None

    return {f"{name}s_kept": len(ordered), f"{name}_ms_p50": at(0.5), f"{name}_ms_p99": at(0.99),
            f"{name}_ms_max": at(1.0)}
