"""Does a job's walltime leave room to serve behind an endpoint that hands jobs over? Pure: `up`
(preflight), the doctor and the endpoint's walltime handover ask the same question with the figures
they have (estimated before any measurement, measured afterwards).

A member's successor is launched `lead` before the member's job ends:

    lead = queue + HANDOVER_STARTUP_FACTOR x startup + HANDOVER_MARGIN_S

(queue: the wait Slurm expects for the successor; startup: job start to serving). Slurm's queue
estimates assume every running job uses its whole limit, so a successor often starts sooner than
expected; then it serves next to its predecessor, and the predecessor's time from the successor's
launch on is overlap. At worst a job serves alone for walltime - lead: when that is less than
MIN_SERVING_SHARE of the walltime, most of every job is handover, and the deployment is refused with the
walltime that would work. (That bound also leaves each job its startup before its own successor is due:
4/3 x lead >= queue + 2 x startup.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Before any measurement: a conservative start-up (Ray, health check, vLLM, first completion) before the
# weights are read, and the shared filesystem's read rate for the weights.
LOAD_BASE_S = 120.0
READ_BYTES_PER_S = 500e6
HANDOVER_STARTUP_FACTOR = 1.5  # startups vary with the node and the file system's mood
HANDOVER_MARGIN_S = 60.0
MIN_SERVING_SHARE = 0.25  # a job that serves alone less than this share of its walltime is mostly handover


def estimated_startup_s(weight_bytes: int | None) -> float:
    """A start-up before any was measured: the base plus reading the weights once."""
    return LOAD_BASE_S + (weight_bytes or 0) / READ_BYTES_PER_S


def startup_before_measurement(weight_bytes: int | None, stated_s: float | None) -> tuple[float, str]:
    """A member's startup before this deployment measured one, with where it comes from: serve.startup_s
    when the user states it (measured on their cluster), else estimated from the weights."""
    if stated_s:
        return stated_s, "serve.startup_s"
    what = f"{weight_bytes / 1e9:.1f} GB of weights" if weight_bytes else "no local weights"
    return estimated_startup_s(weight_bytes), (f"estimated before any measurement: {LOAD_BASE_S:.0f} s + {what} at "
                                               f"{READ_BYTES_PER_S / 1e6:.0f} MB/s")


def handover_lead_s(queue_s: float, startup_s: float) -> float:
    return queue_s + HANDOVER_STARTUP_FACTOR * startup_s + HANDOVER_MARGIN_S


@dataclass(frozen=True)
class WalltimeCheck:
    """What a walltime leaves to serve, from the startup and queue wait given (with where they came from)."""

    walltime_s: float
    startup_s: float
    queue_s: float
    startup_basis: str  # "estimated: ..." or "measured ...: m1 212 s"
    queue_basis: str  # "sbatch --test-only at ..." or "no estimate"

    @property
    def lead_s(self) -> float:
        return handover_lead_s(self.queue_s, self.startup_s)

    @property
    def serving_s(self) -> float:
        """What a job serves alone at worst (its successor starting as soon as it is submitted)."""
        return self.walltime_s - self.lead_s

    @property
    def enough(self) -> bool:
        return self.serving_s >= MIN_SERVING_SHARE * self.walltime_s

    @property
    def walltime_that_works_s(self) -> float:
        """The shortest walltime in whole minutes that leaves MIN_SERVING_SHARE to serve."""
        return 60.0 * math.ceil(self.lead_s / (1 - MIN_SERVING_SHARE) / 60.0 - 1e-9)

    def problem(self, time_field: str) -> str | None:
        """One message: what cannot work, from which figures, and the walltime that would; or None."""
        if self.enough:
            return None
        fix = f"Set {time_field} to at least {slurm_time_text(self.walltime_that_works_s)}"
        if self.startup_basis.startswith("estimated"):
            fix += ", or state the startup measured on your cluster as serve.startup_s"
        return f"{self.what(time_field)}. {fix}"

    def what(self, time_field: str) -> str:
        queue = f"queue ~{self.queue_s:.0f} s ({self.queue_basis}) + " if self.queue_s else ""
        return (f"{time_field} = {minutes_text(self.walltime_s)} is too short for walltime handovers: a job's "
                f"successor must be launched ~{self.lead_s:.0f} s before the job ends ({queue}"
                f"{HANDOVER_STARTUP_FACTOR:g} x startup ~{self.startup_s:.0f} s ({self.startup_basis}) + "
                f"{HANDOVER_MARGIN_S:.0f} s), so each job would serve alone for {max(0.0, self.serving_s):.0f} s, "
                "less than a quarter of its time")


def minutes_text(seconds: float) -> str:
    return f"{seconds / 60:g} min"


def slurm_time_text(seconds: float) -> str:
    """Seconds as Slurm's H:MM:SS in whole minutes, rounded up: 330 -> "0:06:00"."""
    total = math.ceil(seconds / 60.0 - 1e-9)
    return f"{total // 60}:{total % 60:02d}:00"
