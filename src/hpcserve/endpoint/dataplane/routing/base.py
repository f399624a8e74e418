"""The interface every routing policy implements (one module per policy beside this one), and the
candidates every policy chooses among. No I/O."""

from __future__ import annotations

from typing import Protocol

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane.routing.table import Affinity, Backend, RoutingTable


class RoutingPolicy(Protocol):
    """One way to choose a backend (core.statuses.Routing names it)."""

    name: Routing

    def pick(self, pool: RoutingTable, eligible: list[Backend], affinity: Affinity | None, now: float) -> Backend:
        """The backend for the next request among eligible (never empty: candidates() of the pool, another
        than those a retry tried where there is one); pool.turn has advanced for this choice."""


def has_room(backend: Backend, now: float) -> bool:
    """Not failed, a free slot by the data plane's own count, and no saturation mark."""
    return backend.failed_until <= now and not backend.saturated and backend.in_flight < backend.capacity


def candidates(backends: list[Backend], now: float) -> list[Backend]:
    """Those that may take a request now: not failed; and, while another has room, not one without.
    Room is a free slot by the data plane's own count and no saturation mark: the mark comes from the
    engine's metrics a poll late, so a full replica still looks unmarked for a while, and taking it as
    room sent every request to a 1-slot replica while an 8-slot one was marked (4 queued there)."""
    alive = [b for b in backends if b.failed_until <= now]
    roomy = [b for b in alive if has_room(b, now)]
    return roomy or alive
