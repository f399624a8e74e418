"""Load-aware choice from vLLM's /metrics: which backends the data plane should treat as saturated now.

The data plane balances by its own in-flight counts per unit of each backend's capacity, which already
gives replicas of unequal size their share. What it cannot see is an engine's own state: requests
queueing inside it with every slot taken (other clients, probes) or a KV cache nearly full (a capacity
set too high). The controller reads /metrics a few times a second and marks such backends saturated; the data plane then
skips them while another has room (the data plane's routing.base.candidates), and uses them all when all are saturated
(queueing anywhere beats refusing). Marks change the data plane's choice, never its membership, so no
backend is ever removed and added back for load (what vllm-router needed, with a moment of none).
The choice is pure (saturated_now, next_saturated); Rotation sends it to the router when it changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from hpcserve.endpoint.control.plane_client import Router
from hpcserve.engine.metrics import EngineLoad, is_saturated


def saturated_now(loads: dict[str, EngineLoad | None], marked: set[str], capacities: dict[str, int] | None = None,
                  max_waiting: float = 0.0, max_kv_usage: float = 0.95, resume_kv_usage: float = 0.85) -> set[str]:
    """A backend whose engine queues requests (waiting > max_waiting) with all its slots running (running
    >= its capacity, when known) or whose KV cache is nearly full is marked; a marked one stays marked
    until its queue is empty and its KV cache below resume_kv_usage (the gap stops flapping). A request
    also waits for one scheduler step in an engine with free slots: marking that skipped an 8-slot
    replica running 5 for a 1-slot one already running its one (the heterogeneous-pool test, 2026-12-02).
    A backend without figures (None) keeps its mark (its probes decide about dead ones). Pure."""
    now = set()
    for url, load in loads.items():
        was = url in marked
        if load is None:
            now |= {url} if was else set()
            continue
        drained = load.waiting == 0 and (load.kv_cache_usage is None or load.kv_cache_usage < resume_kv_usage)
        if (was and not drained) or (not was and is_saturated(load, max_waiting, max_kv_usage,
                                                              (capacities or {}).get(url, 0))):
            now.add(url)
    return now


def next_saturated(pool: list[str], answered: set[str], loads: Mapping[str, EngineLoad | None], marked: set[str],
                   capacities: dict[str, int] | None = None) -> set[str]:
    """The marks after one round of the controller. Only backends whose last probe answered are judged
    (a dying one's stale figures decide nothing); the others keep their marks; backends gone from the
    pool are forgotten. Pure."""
    judged = [url for url in pool if url in answered]
    now = saturated_now({url: loads.get(url) for url in judged}, marked & set(judged), capacities)
    return now | ((marked & set(pool)) - set(judged))


class Rotation:
    """The saturation marks of the pool's backends, sent to the data plane when they change. The
    controller drives it every ROTATION_S; `paused` is the name state.json has shown them under."""

    def __init__(self, router: Router):
        self.router = router
        self.paused: set[str] = set()  # saturated now: skipped by the data plane while another has room

    def update(self, pool: list[str], answered: set[str], loads: Mapping[str, EngineLoad | None],
               suspect: AbstractSet[str] = frozenset()) -> None:
        """suspect: backends whose probes answer too late (busy or frozen): marked, as if saturated."""
        marked = next_saturated(pool, answered, loads, self.paused, self.router.capacities()) | (suspect & set(pool))
        self.router.set_saturated(marked)  # one admin call, only when a mark changed
        self.paused = marked
