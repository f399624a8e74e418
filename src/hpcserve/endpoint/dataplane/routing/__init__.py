"""Which replica takes a request: the routing state (table: the backends, the hash ring, the indexes of
what each replica's prefix cache holds) and the policies, one module each behind base.RoutingPolicy:

    least_loaded  in flight per unit of capacity, ties in turn (least_loaded.py)
    round_robin   each in turn (round_robin.py)
    prefix        where the prompt's prefix is cached, or its session pinned, within bounds of load (prefix.py)

Every policy chooses among base.candidates: a backend marked failed (a connection error, for a few seconds)
is skipped and, while another has room, one without: every slot taken by requests in flight through here,
or marked saturated by the controller (its engine queues requests or its KV cache is full). When none has
room, all are candidates. choose() is the data plane's one call. No I/O.
"""

from __future__ import annotations

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane.routing.base import RoutingPolicy, candidates
from hpcserve.endpoint.dataplane.routing.least_loaded import LeastLoaded
from hpcserve.endpoint.dataplane.routing.prefix import Prefix
from hpcserve.endpoint.dataplane.routing.round_robin import RoundRobin
from hpcserve.endpoint.dataplane.routing.table import Affinity, Backend, RoutingTable

POLICIES: dict[Routing, RoutingPolicy] = {policy.name: policy for policy in (LeastLoaded(), RoundRobin(), Prefix())}


def choose(pool: RoutingTable, policy: Routing, affinity: Affinity | None, now: float,
           tried: tuple[Backend, ...] = ()) -> Backend | None:
    """The backend for the next request; None when none may take it now (the caller holds the request).
    A retry names the backends it tried: another one is preferred while there is one. The prefix policy
    records the prompt's blocks where it sends them."""
    eligible = candidates(pool.active, now)
    if tried:
        eligible = [b for b in eligible if b not in tried] or eligible
    if not eligible:
        return None
    pool.turn += 1
    return POLICIES[policy].pick(pool, eligible, affinity, now)
