"""Admission: which waiting request goes next when the replicas' KV caches are taken by prompts in flight.

Under traffic whose shared prefixes outgrow the replicas' KV caches, a router alone decides only where a
prefix lives; which prefix is still cached when its repeat comes is then the engines' LRU, and that is the
same for any router that gives each prefix one home (benchmarks/results/routing.md). What a router can still
change is the order: a request whose prefix is cached now costs a short prefill if it runs now, and a whole
one if it runs after the prefix was evicted. So while the prompts in flight through this process take more
than `share` of the replicas' KV caches, a request that would start a new prefill waits here, and when one
ends the next to go is a waiting request that some replica holds most of (SGLang's longest-prefix-match
scheduling, across replicas); otherwise the oldest. A request waits here at most AGE_S before it goes first.

    admission = Admission(pool, share=0.4, workers=2)
    async with admission.turn(affinity):          # at once while there is room, else in its turn
        ...forward the request...

What counts: the prompt tokens a replica must prefill and store (those it does not hold), not the output,
which grows one token at a time: decode-heavy traffic (short prompts, long answers) never waits. Admission
works only where the prompt is known as token ids and every replica's KV cache size is known (the prefix
policy with the engines' KV events followed); otherwise every request goes at once. Each worker process of
the data plane admits its own requests against its share (1 / workers) of the caches.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from itertools import islice

from hpcserve.endpoint.dataplane.routing.table import MATCH_FRACTION, Affinity, RoutingTable, cached_share

# The share of the replicas' KV caches that prompts in flight may take before new prefills wait; the lower,
# the more requests wait here to be reordered. On the GPU benchmark (128 requests of 2,000 tokens in flight,
# two 131,072-token caches, benchmarks/results/routing.md): 0.6 gave 1.03x cache_aware's throughput, 0.4 1.08x
# (hits 1.32x what the engines' LRU allows alone), 0.25 no more than 0.4 and a later median first token.
DEFAULT_SHARE = 0.4
# The longest a request waits while others (whose prefix is cached) go before it: then it goes first.
AGE_S = 5.0
SCAN = 64  # waiting requests looked at for a cached prefix per admission: bounds the work per request end


@dataclass(slots=True, eq=False)
class Ticket:
    """One request's place: what it charges while in flight (tokens to prefill), once admitted."""

    affinity: Affinity | None
    since: float
    cost: int = 0
    granted: asyncio.Future | None = field(default=None, repr=False)


def prefill_cost(pool: RoutingTable, affinity: Affinity | None, now: float) -> tuple[int, bool]:
    """The prompt tokens a replica must prefill for this request (the most that any replica holds taken
    off), and whether some replica holds a part of the prompt worth following there (MATCH_FRACTION)."""
    if affinity is None or not affinity.tokens:
        return 0, False
    held = max((cached_share(pool, b.url, affinity, now) for b in pool.active), default=0.0)
    return round(len(affinity.tokens) * (1.0 - held)), held >= MATCH_FRACTION


def next_admitted(costs: Iterable[tuple[int, bool, float]], room: int, idle: bool, now: float) -> int | None:
    """Which waiting request goes next (its position in costs), or None while none may. costs: each waiting
    request's (prefill cost, prefix held somewhere, since when), oldest first, read only as far as needed
    (at most SCAN). room: tokens left within the budget; idle: nothing in flight (then the oldest goes
    whatever it costs). Pure."""
    costs = iter(costs)
    oldest = next(costs, None)
    if oldest is None:
        return None
    oldest_cost, oldest_held, oldest_since = oldest
    fits = idle or oldest_cost <= room
    if idle or now - oldest_since >= AGE_S or (oldest_held and fits):  # nothing passes an old request
        return 0 if fits else None
    for i, (cost, held, _) in enumerate(islice(costs, SCAN - 1), start=1):
        if held and cost <= room:
            return i
    return 0 if fits else None


class Admission:
    def __init__(self, pool: RoutingTable, share: float, workers: int = 1):
        self.pool, self.share, self.workers = pool, share, workers
        self.in_flight = 0  # prefill tokens charged by the requests admitted and not ended
        self.admitted = 0  # requests admitted and not ended
        self.waiting: deque[Ticket] = deque()
        self.waits = 0  # requests that waited (a counter)

    def budget(self) -> int | None:
        """Prefill tokens this process may have in flight; None while admission is off (a replica's KV cache
        size unknown, or no replica)."""
        sizes = [self.pool.kv_tokens.get(b.url) for b in self.pool.active]
        if self.share <= 0 or not sizes or None in sizes:
            return None
        return int(self.share * sum(sizes) / self.workers)

    @asynccontextmanager
    async def turn(self, affinity: Affinity | None) -> AsyncIterator[Ticket]:
        """The request's turn: entered at once while there is room, else in its order; left at its end."""
        ticket = await self.enter(affinity)
        try:
            yield ticket
        finally:
            self.leave(ticket)

    async def enter(self, affinity: Affinity | None) -> Ticket:
        """Returns once the request may go on (it then holds its ticket until leave)."""
        now = time.monotonic()
        ticket = Ticket(affinity, now)
        budget = self.budget()
        if budget is None or affinity is None or not affinity.tokens:
            self.grant(ticket, 0)
            return ticket
        if not self.waiting:
            cost, _ = prefill_cost(self.pool, affinity, now)
            if self.admitted == 0 or self.in_flight + cost <= budget:
                self.grant(ticket, cost)
                return ticket
        ticket.granted = asyncio.get_running_loop().create_future()
        self.waiting.append(ticket)
        self.admit()  # a prefix held somewhere may go before those waiting
        if ticket.granted.done():
            return ticket
        self.waits += 1
        try:
            await ticket.granted
        except asyncio.CancelledError:  # the client left: its place goes, or what it was granted
            if ticket.granted.done() and not ticket.granted.cancelled():
                self.leave(ticket)
            elif ticket in self.waiting:
                self.waiting.remove(ticket)
            raise
        return ticket

    def grant(self, ticket: Ticket, cost: int) -> None:
        if ticket.granted is not None:
            if ticket.granted.cancelled():  # its client left while it waited: nothing to charge
                return
            ticket.granted.set_result(None)
        ticket.cost = cost
        self.in_flight += cost
        self.admitted += 1

    def leave(self, ticket: Ticket) -> None:
        """The request ended (answered, failed, or its client left)."""
        self.in_flight -= ticket.cost
        self.admitted -= 1
        self.admit()

    def admit(self) -> None:
        """Let waiting requests in while there is room (also after the pool changed: the budget with it)."""
        while self.waiting:
            budget = self.budget()
            now = time.monotonic()
            if budget is None:  # admission is off now: all go
                while self.waiting:
                    self.grant(self.waiting.popleft(), 0)
                return
            costs: list[tuple[int, bool, float]] = []  # computed as next_admitted reads them

            def each_cost() -> Iterator[tuple[int, bool, float]]:
                for ticket in self.waiting:
                    costs.append((*prefill_cost(self.pool, ticket.affinity, now), ticket.since))
                    yield costs[-1]

            pick = next_admitted(each_cost(), budget - self.in_flight, self.admitted == 0, now)
            if pick is None:
                return
            ticket = self.waiting[pick]
            del self.waiting[pick]
            self.grant(ticket, costs[pick][0])
