"""least_loaded: requests in flight through the data plane divided by the backend's capacity (its
engine's --max-num-seqs), the smallest wins; ties go in turn, so an idle pool is used evenly. Replicas of
unequal size get traffic in proportion to what they run at once."""

from __future__ import annotations

import math

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane.routing.table import Affinity, Backend, RoutingTable


class LeastLoaded:
    name = Routing.LEAST_LOADED

    def pick(self, pool: RoutingTable, eligible: list[Backend], affinity: Affinity | None, now: float) -> Backend:
        return least_loaded(eligible, pool.turn)


def least_loaded(backends: list[Backend], turn: int) -> Backend:
    """The smallest in_flight / capacity; among equals, the first from position `turn` on."""
    size = len(backends)
    best, best_load = backends[turn % size], math.inf
    for step in range(size):
        backend = backends[(turn + step) % size]
        load = backend.in_flight / backend.capacity
        if load < best_load:
            best, best_load = backend, load
    return best
