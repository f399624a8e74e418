"""The endpoint controller's decisions, as pure functions over what it observed (tested without a cluster).

- health:   when a backend leaves the pool (failed probes) and when a joining one may take traffic
- autoscale: when to add a replica (queue above target for a while) or drain one (idle for a while)
- walltime: when a job must get its successor, so the endpoint outlives the job's time limit
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from hpcserve.core.config import AutoscaleSpec
from hpcserve.core.statuses import MemberRole
from hpcserve.engine.metrics import EngineLoad

# A backend whose probes failed this many times in a row leaves the pool. With a probe every second
# and a one-second timeout, a dead backend is out within about 3 s.
FAILED_PROBES_TO_LEAVE = 2
# Launches (replacements, successors) in one round, the rest in the next ones: when 10 % of 256 replicas
# are lost at once, or 256 jobs started together reach their time limit together, 25 or 256 sbatch in
# one round would hold it for seconds and hit slurmctld as a burst; four a round spread them out.
LAUNCHES_PER_ROUND = 4
# A successor starts this many times its predecessor's measured startup before the time limit, plus
# the margin below: the load time varies with the node and the file system's mood.
HANDOVER_STARTUP_FACTOR = 1.5
HANDOVER_MARGIN_S = 60.0


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str = ""


def should_leave(recent: list[ProbeResult]) -> bool:
    """The last FAILED_PROBES_TO_LEAVE probes all failed."""
    tail = recent[-FAILED_PROBES_TO_LEAVE:]
    return len(tail) == FAILED_PROBES_TO_LEAVE and not any(p.ok for p in tail)


def probes_due(backends: list[str], last_started: dict[str, float], now: float, every_s: float,
               step_s: float) -> list[str]:
    """The backends to probe (/health and /metrics) in this step of the controller's loop (one every
    step_s). Each is probed every every_s, and a step probes at most its share of the pool (the most
    overdue first), so the probes of 256 replicas spread evenly over the second instead of 512
    requests in one burst each round; replicas that joined together drift apart within a second.
    Pure."""
    share = max(1, math.ceil(len(backends) * step_s / every_s))
    due = sorted((last_started.get(url, float("-inf")), url) for url in backends
                 if now - last_started.get(url, float("-inf")) >= every_s - step_s / 2)
    return [url for _, url in due[:share]]


def reads_due(backends: list[str], loads: dict[str, EngineLoad], paused: set[str], last_read: dict[str, float],
              now: float, busy_every_s: float, idle_every_s: float) -> list[str]:
    """The backends whose /metrics the load-aware rotation reads now. One with requests running or
    waiting, or paused (it must come back as soon as its queue empties), or whose load is not known
    yet, is read every busy_every_s; an idle one every idle_every_s (the round's probe reads it
    anyway): at 256 replicas an idle endpoint costs 256 page reads a second, not 1,280 (a page is
    50 KB). A request that lands on an idle replica is seen by the next probe or by the router's own
    balancing. Pure."""
    def every(url: str) -> float:
        load = loads.get(url)
        busy = url in paused or load is None or load.in_flight > 0
        return busy_every_s if busy else idle_every_s

    # A little early is on time: reads are scheduled by a loop that wakes every busy_every_s
    return [url for url in backends if now - last_read.get(url, float("-inf")) >= every(url) - busy_every_s / 2]


# ------------------------------------------------------------------ autoscale

@dataclass(frozen=True)
class LoadSample:
    """One scrape of every active backend: requests waiting and running on each (from /metrics)."""

    time: float
    waiting: dict[str, float]
    running: dict[str, float]
    finished: dict[str, float] = field(default_factory=dict)  # each engine's finished-requests counter

    def waiting_per_replica(self) -> float:
        return sum(self.waiting.values()) / max(1, len(self.waiting))


@dataclass(frozen=True)
class ScaleDecision:
    action: Literal["up", "down", "hold"]
    reason: str
    backend: str | None = None  # for "down": the one to drain

    def as_dict(self) -> dict:
        return {"action": self.action, "reason": self.reason, "backend": self.backend}


def decide_scale(spec: AutoscaleSpec, history: list[LoadSample], replicas: int, starting: int,
                 idle_since: dict[str, float], now: float) -> ScaleDecision:
    """replicas: backends taking traffic; starting: replicas submitted but not yet in the pool;
    idle_since: backend -> when it last had a request waiting or running."""
    total = replicas + starting
    if total < spec.min:
        return ScaleDecision("up", f"{total} replica(s) running or starting, fewer than autoscale.min {spec.min}")
    if starting:
        return ScaleDecision("hold", f"{starting} replica(s) still starting")
    window = [s for s in history if s.time >= now - spec.scale_up_after_s]
    covered = bool(history) and history[0].time <= now - spec.scale_up_after_s
    if covered and window and all(s.waiting_per_replica() > spec.target_queue for s in window):
        queue = min(s.waiting_per_replica() for s in window)
        if total >= spec.max:
            return ScaleDecision("hold", f"{queue:.1f} waiting per replica > target {spec.target_queue:g}, "
                                 f"but already at autoscale.max {spec.max}")
        return ScaleDecision("up", f"at least {queue:.1f} requests waiting per replica for {spec.scale_up_after_s:g} s "
                             f"(target {spec.target_queue:g})")
    idle = sorted((since, backend) for backend, since in idle_since.items() if now - since >= spec.scale_down_after_s)
    if idle and replicas > spec.min:
        since, backend = idle[0]
        return ScaleDecision("down", f"{backend} idle for {now - since:.0f} s (>= {spec.scale_down_after_s:g} s) and "
                             f"{replicas} replicas > autoscale.min {spec.min}", backend)
    return ScaleDecision("hold", "load within target")


def update_idle_since(idle_since: dict[str, float], sample: LoadSample,
                      previous: LoadSample | None = None) -> dict[str, float]:
    """A backend with nothing waiting or running, and no request finished since the previous sample, keeps
    its idle start; a busy one is reset to now. (Short requests between two samples are seen only by the
    finished counter: without it, a replica serving one quick request every few seconds looks idle.)"""
    out = {}
    for backend in sample.waiting:
        busy = sample.waiting.get(backend, 0) + sample.running.get(backend, 0) > 0
        if previous is not None and backend in sample.finished and backend in previous.finished:
            busy = busy or sample.finished[backend] > previous.finished[backend]
        out[backend] = sample.time if busy else idle_since.get(backend, sample.time)
    return out


def replace_failed_launch(role: MemberRole) -> bool:
    """Does self-healing replace a member that failed before it served? Not a scale-up or a successor:
    the autoscaler and the walltime handover decide again next round whether one is still needed, and a
    replacement on top would launch two."""
    return role not in (MemberRole.SCALE_UP, MemberRole.SUCCESSOR)


# ------------------------------------------------------------------ walltime

def handover_lead_s(startup_s: float | None, configured_s: float | None) -> float:
    """How long before a job's end its successor is submitted."""
    if configured_s is not None:
        return configured_s
    return HANDOVER_STARTUP_FACTOR * (startup_s or 300.0) + HANDOVER_MARGIN_S


def handover_due(end_time: str | None, now: datetime, lead_s: float) -> bool:
    """end_time is Slurm's EndTime (ISO, no zone: the cluster's local time), None/Unknown for no limit."""
    if not end_time or end_time in ("Unknown", "N/A", "NONE"):
        return False
    try:
        ends = datetime.fromisoformat(end_time)
    except ValueError:
        return False
    return (ends - now).total_seconds() <= lead_s
