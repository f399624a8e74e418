"""Load-aware rotation over the router: which of the pool's backends take new requests now.

vllm-router balances by its own in-flight counts; it cannot read vLLM's /metrics. The controller reads
them and keeps a backend whose engine queues requests (or whose KV cache is nearly full) out of the
router's rotation while another has room. The choice is pure (backends_to_pause, next_paused); Rotation
applies it to a router. benchmarks/router_capacity.py measures it alone.
"""

from __future__ import annotations

from hpcserve.endpoint.router import Router
from hpcserve.engine.metrics import EngineLoad, is_saturated


def backends_to_pause(loads: dict[str, EngineLoad | None], paused: set[str], max_waiting: float = 0.0,
                      max_kv_usage: float = 0.95, resume_kv_usage: float = 0.85) -> set[str]:
    """Load-aware choice from vLLM's /metrics, for a data plane that cannot read them: the backends to keep
    out of the router's rotation now. A backend whose engine queues requests (waiting > max_waiting) or
    whose KV cache is nearly full is paused while another one has room; it comes back once its queue is
    empty and its KV cache below resume_kv_usage (the gap stops flapping). Never all of them: when every
    backend is saturated, queueing anywhere beats refusing. A backend without load figures (None) is left
    as it is (the probe decides about dead ones). Pure."""
    def saturated(load: EngineLoad) -> bool:
        return is_saturated(load, max_waiting, max_kv_usage)

    def recovered(load: EngineLoad) -> bool:
        return load.waiting == 0 and (load.kv_cache_usage is None or load.kv_cache_usage < resume_kv_usage)

    now = set()
    for url, load in loads.items():
        was = url in paused
        if load is None:
            now |= {url} if was else set()
        elif (was and not recovered(load)) or (not was and saturated(load)):
            now.add(url)
    return now if len(now) < len(loads) else set()


def next_paused(pool: list[str], answered: set[str], loads: dict[str, EngineLoad | None], paused: set[str]) -> set[str]:
    """The backends out of rotation after one round of the controller. Only backends whose last probe
    answered are judged: pausing the one healthy backend because a dying one still "has room" would
    leave the router with none. A paused backend whose probe failed stays paused (its probes decide
    whether it leaves the pool): forgetting it would leave it out of the router for good, and a later
    round could pause the last backend still in it. Backends gone from the pool are forgotten. Pure."""
    judged = [url for url in pool if url in answered]
    now = backends_to_pause({url: loads.get(url) for url in judged}, paused & set(judged))
    return now | ((paused & set(pool)) - set(judged))


class Rotation:
    """Load-aware rotation over a router (next_paused applied): which of the pool's backends take new
    requests now. The controller drives it; benchmarks/router_capacity.py measures it alone."""

    def __init__(self, router: Router):
        self.router = router
        self.paused: set[str] = set()  # in the pool, but out of the router's rotation for now

    def update(self, pool: list[str], answered: set[str], loads: dict[str, EngineLoad | None]) -> None:
        paused = next_paused(pool, answered, loads, self.paused)
        # Resumed ones first: removing first would leave the router without a backend for the time an add
        # takes (~60 ms), and it answers 503 "No available workers" meanwhile (seen on the sandbox).
        # Each batch is one router.apply: at 256 replicas a round may change dozens at once.
        resume = sorted(url for url in self.paused - paused if url in pool)  # left the pool: stays out
        if resume:
            paused |= self.router.apply(add=resume)  # stopped answering since its probe: paused still
        if pool and set(pool) <= paused:  # a failed add broke "never all of them": pause nobody new
            paused = paused & self.paused
        pause = sorted(paused - self.paused)
        if pause:
            self.router.apply(remove=pause)
        self.paused = paused
