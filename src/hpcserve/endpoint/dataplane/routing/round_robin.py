"""round_robin: each backend in turn."""

from __future__ import annotations

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane.routing.table import Affinity, Backend, RoutingTable


class RoundRobin:
    name = Routing.ROUND_ROBIN

    def pick(self, pool: RoutingTable, eligible: list[Backend], affinity: Affinity | None, now: float) -> Backend:
        return eligible[pool.turn % len(eligible)]
