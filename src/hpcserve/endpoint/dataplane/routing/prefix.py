"""prefix: by what each replica's prefix cache holds: exactly, from its engine's KV events (token_index,
fed by kv_feed), and approximately, from the prompts sent there (prefix_index), where the events do not
cover it (table.cached_share). The replica holding the largest part of the prompt takes it, while that
part is at least MATCH_FRACTION of the prompt and the replica carries no more than BALANCE_SLACK of its
capacity above the least loaded; otherwise the replica with the most room (load, then cache fill) takes
it, and its repeats follow it there. A session header (X-Session-ID, X-User-ID) instead pins the
conversation by bounded-load consistent hashing: within (1 + PREFIX_EPSILON) x its share of what is in
flight. Where it sends a prompt is recorded in both indexes (table.record). No I/O."""

from __future__ import annotations

import math

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane.routing.least_loaded import least_loaded
from hpcserve.endpoint.dataplane.routing.table import (
    MATCH_FRACTION,
    Affinity,
    Backend,
    RoutingTable,
    cache_fill,
    cached_share,
    record,
)

# A preferred backend may carry up to 1.25 x its share before prefix affinity yields to balance: the
# bound of consistent hashing with bounded loads (Mirrokni et al. 2018), where 0.25 keeps most requests
# on their preferred replica while no replica gets more than 1.25 x the mean.
PREFIX_EPSILON = 0.25
# How far the replica holding a prefix may be loaded above the lightest before balance wins: a quarter of
# its capacity (64 of vLLM's 256 sequences, vllm-router's --balance-abs-threshold). A repeat sent elsewhere
# pays a whole prefill again, a little more load only a little decode time: the bound is loose on purpose.
# An eighth (32) split about 1 prefix in 50 on the GPU at 128 in flight (holders at 53-55 against 17-22),
# where cache_aware kept them (benchmarks/results/routing.md).
BALANCE_SLACK = 0.25


class Prefix:
    name = Routing.PREFIX

    def pick(self, pool: RoutingTable, eligible: list[Backend], affinity: Affinity | None, now: float) -> Backend:
        if affinity is None:
            return least_loaded(eligible, pool.turn)
        chosen = None
        if affinity.session is not None:
            preferred = pool.ring.owner(affinity.session, eligible)
            if preferred is not None and within_share(preferred, eligible):
                chosen = preferred
        elif affinity.has_prompt:
            chosen = cache_holder(pool, eligible, affinity, pool.turn, now)
        if chosen is None:
            chosen = (roomiest(pool, eligible, pool.turn, now) if affinity.has_prompt
                      else least_loaded(eligible, pool.turn))
        record(pool, chosen.url, affinity, now)
        return chosen


def within_share(backend: Backend, backends: list[Backend], epsilon: float = PREFIX_EPSILON) -> bool:
    """One more request on backend keeps it within (1 + epsilon) x its capacity's share of everything in
    flight (counting the new one). Rounded up, so an idle pool always keeps affinity."""
    total = sum(b.in_flight for b in backends) + 1
    capacity = sum(b.capacity for b in backends)
    return backend.in_flight + 1 <= math.ceil((1 + epsilon) * total * backend.capacity / capacity)


def cache_holder(pool: RoutingTable, backends: list[Backend], affinity: Affinity, turn: int,
                 now: float) -> Backend | None:
    """The backend holding the largest leading part of the prompt (the least loaded of those that hold as
    much), when that part is worth following and that backend is not overloaded; else None."""
    shares = [cached_share(pool, b.url, affinity, now) for b in backends]
    largest = max(shares)
    if largest == 0 or largest < MATCH_FRACTION:
        return None
    holder = least_loaded([b for b, s in zip(backends, shares) if s == largest], turn)
    lightest = min(b.load() for b in backends)
    return holder if holder.load() - lightest <= BALANCE_SLACK else None


def roomiest(pool: RoutingTable, backends: list[Backend], turn: int, now: float) -> Backend:
    """Where a new prefix has most room: the smallest load plus cache fill; among equals, in turn."""
    size = len(backends)
    best, best_score = backends[turn % size], math.inf
    for step in range(size):
        backend = backends[(turn + step) % size]
        score = backend.load() + cache_fill(pool, backend.url, now)
        if score < best_score:
            best, best_score = backend, score
    return best
