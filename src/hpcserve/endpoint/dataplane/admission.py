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

Fair share (with tenants: users' own keys). Then requests also wait here while the replicas are full,
rather than in the engines' first-come queues, and the next to go is chosen fairly: among the projects with
requests waiting, the one with the least service so far for its weight (tenancy.shares, as Slurm's fair-share
weights accounts), then among its users the same way with equal weights (start-time fair queueing, twice: a
project or user that was idle gets no credit for it, and none is starved). Among one user's requests the
order is the one above: a prefix held somewhere goes first. Full means: for a user alone, the requests
admitted reach the replicas' capacities (their engines' --max-num-seqs) plus one each, so that no engine
idles between two requests; while several users are active, the capacities alone, so that an admitted
request starts in a running batch at once (routing sends it to a replica with a free place) instead of
waiting in an engine's queue behind another user's. Either way a lone user's excess waits here, not in the
engines: the controller counts it as the model's queue (GET /backends "waiting") for the autoscaler.

A user at or above their share of the places (a batch job) takes a free place only where that leaves RESERVE
places for a newcomer and the places users below their share freed in the last KEEP_S seconds: such a
user's next request starts at once in a place of their own instead of waiting for one of the batch job's to
end. (Requests of one length admitted together end together: a batch job's places free in waves, seconds
apart, and a light user who had to wait for the next wave waited half of one request's time at the median.)

Where a user below their share must wait all the same (every place of the running batches taken), one stream
of the user furthest above theirs pauses (tenancy.pause_streams): the data plane closes it at its engine,
which frees the place at once, and the waiting request takes it. The paused stream waits here, first among
its user's requests, and continues from its token ids when a place frees, on the replica whose prefix cache
still holds them where it has room (a continuation, as after a replica's failure: streams.py); its client
sees one unbroken stream, only slower. A stream pauses at most once; only streamed requests that can continue
elsewhere pause (migration.why_not). Where requests wait in the engines' queues (a user who was alone took the
extra place per engine), as many more streams pause: an engine gives the first place freed to its queue.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from itertools import islice

from hpcserve.endpoint.dataplane.metrics import observe, wait_histogram
from hpcserve.endpoint.dataplane.routing.table import MATCH_FRACTION, Affinity, RoutingTable, cached_share

# The share of the replicas' KV caches that prompts in flight may take before new prefills wait; the lower,
# the more requests wait here to be reordered. On the GPU benchmark (128 requests of 2,000 tokens in flight,
# two 131,072-token caches, benchmarks/results/routing.md): 0.6 gave 1.03x cache_aware's throughput, 0.4 1.08x
# (hits 1.32x what the engines' LRU allows alone), 0.25 no more than 0.4 and a later median first token.
DEFAULT_SHARE = 0.4
# The longest a request waits while others (whose prefix is cached) go before it: then it goes first.
AGE_S = 5.0
SCAN = 64  # waiting requests looked at for a cached prefix per admission: bounds the work per request end
RESERVE = 1  # places a user at their fair share leaves free while others are active (per worker)
ACTIVE_S = 10.0  # a user who sent a request this recently counts as active (sporadic users too)
# How long the places a user below their share freed stay theirs: long enough to cover the gaps between a
# steady user's requests (their in-flight count moves up and down around its mean), short enough that a
# user who went quiet gives them back within seconds. Each kept place is idle meanwhile.
KEEP_S = 2.0


@dataclass(slots=True, eq=False)
class Ticket:
    """One request's place: what it charges while in flight (tokens to prefill), once admitted; whose it is
    (project, user) where fair share is on."""

    affinity: Affinity | None
    since: float
    cost: int = 0
    granted: asyncio.Future | None = field(default=None, repr=False)
    project: str = ""
    user: str = ""
    out: bool = False  # its stream paused: the place given back while it waits for another (Admission.resume)


class FairQueue:
    """Start-time fair queueing over names (projects, or the users of one): `pick` the name whose next turn
    starts first (its last turn's end, or now for a name that was idle), `served` moves its end on by
    1 / weight. Pure apart from its own tags."""

    def __init__(self, weights: dict[str, float] | None = None):
        self.weights = weights or {}
        self.finish: dict[str, float] = {}
        self.now = 0.0  # the virtual time: the start of the last turn given

    def start(self, name: str) -> float:
        return max(self.now, self.finish.get(name, 0.0))

    def pick(self, names: Iterable[str]) -> str:
        return min(names, key=self.start)  # min keeps the first of equals: the caller lists oldest first

    def served(self, name: str) -> None:
        finish = self.finish
        now = finish.get(name, 0.0)  # start(name), inline: once per request and queue
        if now < self.now:  # noqa: PLR1730 - max() is a call of its own, twice per request
            now = self.now
        self.now = now
        finish[name] = now + 1.0 / self.weights.get(name, 1.0)
        if len(finish) > 4 * 4096:  # names long gone: their tags are behind now and mean nothing
            self.finish = {n: f for n, f in finish.items() if f > now}


class FairShare:
    """Projects weighted by their shares, then the users of each with equal weights: the order of those
    waiting (`choose`), and who may take a place now (`may_go`): while others are active, a user at or above
    their share of the replicas' capacity leaves RESERVE places free, and those the users below their share
    freed within KEEP_S, so that a request of a user below theirs starts at once in an engine instead of
    waiting there for one of the heavy user's to end.

    Who is active (sent a request within ACTIVE_S, or has one in flight) is kept as requests come and go,
    with the active users per project and the projects' summed weights: `may_go` costs the same with ten
    users or ten thousand."""

    def __init__(self, shares: dict[str, float], pauses: bool = True):
        """pauses: a user above their share pauses a stream for a user below theirs who would wait."""
        self.shares, self.pauses = shares, pauses
        self.projects = FairQueue(shares)
        self.users: dict[str, FairQueue] = {}
        self.running: dict[tuple[str, str], int] = {}  # requests in flight per (project, user)
        self.seen: OrderedDict[tuple[str, str], float] = OrderedDict()  # last request's time, oldest first
        self.active_users: dict[str, int] = {}  # per project, its users that are active
        self.active = 0  # users active, in all projects
        self.weight_sum = 0.0  # the shares of the projects with an active user
        # per user who freed places lately: (the most in flight since, until when they are kept), the
        # soonest to lapse first
        self.kept: OrderedDict[tuple[str, str], tuple[int, float]] = OrderedDict()
        self.kept_most = 0  # the kept places' "most" summed: a bound on those kept free (may_go's shortcut)
        self.due = math.inf  # expire has nothing to do before this (it may have nothing then either)

    def arrived(self, project: str, user: str, now: float) -> None:
        self._saw((project, user), now)

    def went(self, project: str, user: str, now: float) -> None:
        """A request that went at once while nothing waited and the pool had room to spare: `arrived` and
        `served` in one, without the queues' turns (they order only requests that wait)."""
        who = (project, user)
        self._saw(who, now)
        self._took(who)

    def _saw(self, who: tuple[str, str], now: float) -> None:
        """A request of this user now: active from here on."""
        seen = self.seen
        if who not in seen:
            if not seen and now + ACTIVE_S < self.due:
                self.due = now + ACTIVE_S
            if who not in self.running:
                self._became_active(who[0])
        seen[who] = now
        seen.move_to_end(who)

    def _took(self, who: tuple[str, str]) -> None:
        """One more of this user's requests in flight (and in the places kept for it, if more than it had)."""
        running = self.running[who] = self.running.get(who, 0) + 1
        held = self.kept.get(who)
        if held is not None and running > held[0]:  # more than it kept: the most in flight moves up
            self.kept[who] = (running, held[1])
            self.kept_most += running - held[0]

    def ended(self, project: str, user: str, now: float | None) -> None:
        """now: None while the pool has room to spare (nothing to keep: the bookkeeping spared)."""
        who = (project, user)
        left = self.running.get(who, 0) - 1
        held = self.kept.get(who)
        if now is not None and (held is None or now >= held[1]):  # the places it had now, kept from here on
            self.kept[who] = (left + 1, now + KEEP_S)
            self.kept.move_to_end(who)
            self.kept_most += left + 1 - (held[0] if held is not None else 0)
            self.due = min(self.due, now + KEEP_S)
        if left > 0:
            self.running[who] = left
            return
        self.running.pop(who, None)
        if who not in self.seen:
            self._became_idle(project)

    def served(self, project: str, user: str) -> None:
        self.projects.served(project)
        users = self.users.get(project)  # _users_of, its call spared once the project has its queue
        (users if users is not None else self._users_of(project)).served(user)
        who = (project, user)
        if who not in self.running and who not in self.seen:
            self._became_active(project)
        self._took(who)

    def expire(self, now: float) -> None:
        """Users whose last request is older than ACTIVE_S and who have none in flight are no longer active;
        places kept longer than KEEP_S are free for anyone."""
        kept = self.kept
        while kept:
            who, (most, until) = next(iter(kept.items()))
            if now < until:
                break
            del kept[who]
            self.kept_most -= most
        seen = self.seen
        while seen:
            who, at = next(iter(seen.items()))
            if now - at < ACTIVE_S:
                break
            del seen[who]
            if who not in self.running:
                self._became_idle(who[0])
        # the next time either has an entry to drop (each is oldest first)
        self.due = min(next(iter(seen.values())) + ACTIVE_S if seen else math.inf,
                       next(iter(kept.values()))[1] if kept else math.inf)

    def _became_active(self, project: str) -> None:
        self.active += 1
        users = self.active_users.get(project, 0)
        self.active_users[project] = users + 1
        if users == 0:
            self._sum_weights()

    def _became_idle(self, project: str) -> None:
        self.active -= 1
        users = self.active_users[project] - 1
        if users:
            self.active_users[project] = users
        else:
            del self.active_users[project]
            self._sum_weights()

    def _sum_weights(self) -> None:  # summed afresh when a project comes or goes: no drift from float sums
        self.weight_sum = sum(self.shares.get(p, 1.0) for p in self.active_users)

    def may_go(self, project: str, user: str, admitted: int, capacity: int, slots: int, now: float) -> bool:
        """Whether a request of this user may take a place now: admitted of slots taken, the replicas
        running capacity at once. A user alone may take all the slots (one request queued in each engine
        keeps it busy between two requests); the rest wait here, where a newcomer can pass them. While
        others are active, requests go only into free places of the running batches: one queued in an
        engine would wait there behind whoever came first."""
        if now >= self.due:
            self.expire(now)
        if admitted >= slots:
            return False
        who = (project, user)
        if self.active == 0 or (self.active == 1 and (who in self.seen or who in self.running)):
            return True  # alone: every place, the extra one per engine included
        if admitted >= capacity:
            return False  # shared: only into a running batch; in an engine's queue no fair order reaches it
        if admitted + RESERVE + self.kept_most < capacity:  # room even if every kept place were free
            return True
        if self.running.get(who, 0) < self.share_of(project, capacity):
            return True  # below its share: any free place
        return admitted + RESERVE + self.kept_for_others(who, capacity) < capacity

    def share_of(self, project: str, capacity: int) -> float:
        """The places one active user of this project is due: its project's weighted part, split evenly."""
        weight = self.shares.get(project, 1.0) / (self.weight_sum or 1.0)
        return capacity * weight / self.active_users.get(project, 1)

    def kept_for_others(self, who: tuple[str, str], capacity: int) -> int:
        """The free places other users freed within KEEP_S (expire has dropped older), each user's counted up
        to their share: a user at or above it has none kept."""
        total = 0
        for other, (most, _) in self.kept.items():
            if other != who:
                total += max(0, min(most, math.ceil(self.share_of(other[0], capacity))) - self.running.get(other, 0))
        return total

    def pause_whom(self, who: tuple[str, str], capacity: int, pausable: Iterable[tuple[str, str]]) -> tuple[str, str] | None:
        """Whose stream pauses so that this user's waiting request starts now: where it is below its share,
        the user among `pausable` furthest above theirs and still at or above it with one stream fewer;
        None where nobody's should. Pure."""
        if self.running.get(who, 0) >= self.share_of(who[0], capacity):
            return None
        chosen, most = None, 1.0
        for other in pausable:
            over = self.running.get(other, 0) - self.share_of(other[0], capacity)
            if over >= most and other != who:
                chosen, most = other, over
        return chosen

    def _users_of(self, project: str) -> FairQueue:
        users = self.users.get(project)
        if users is None:
            users = self.users[project] = FairQueue()
        return users

    def choose(self, waiting: Iterable[Ticket]) -> tuple[str, str]:
        """(project, user) whose request goes next among those waiting (oldest first)."""
        tickets = list(waiting)
        project = self.projects.pick(dict.fromkeys(t.project for t in tickets))
        users = self._users_of(project)
        return project, users.pick(dict.fromkeys(t.user for t in tickets if t.project == project))


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
    def __init__(self, pool: RoutingTable, share: float, workers: int = 1, fair: FairShare | None = None):
        """fair: fair share across projects and users (then requests also wait while the replicas are full)."""
        self.pool, self.share, self.workers, self.fair = pool, share, workers, fair
        self.in_flight = 0  # prefill tokens charged by the requests admitted and not ended
        self.admitted = 0  # requests admitted and not ended
        self.waiting: deque[Ticket] = deque()
        self.waits = 0  # requests that waited (a counter)
        self.waited: dict[str, list[float]] = {}  # per project ('-': none), how long (metrics.wait_histogram)
        # per user, their streams under way that could pause (each one's pause), oldest first
        self.pausable: dict[tuple[str, str], dict[Ticket, Callable[[], bool]]] = {}
        self.pauses = 0  # streams paused (a counter)
        # budget, slots and capacity of the pool's replicas as they were last summed: the pool replaces its
        # list of active replicas (and their sizes) whenever it changes, so they are summed once per change
        self._sized: tuple[list | None, int | None, int | None, int] = (None, None, None, 1)

    def sizes(self) -> tuple[int | None, int | None, int]:
        """(budget, slots, capacity) of the pool as it is now.
        budget: prefill tokens this process may have in flight; None while admission is off (a replica's KV
        cache size unknown, or no replica).
        slots: requests this process may have in flight before the rest wait (fair share only): the
        replicas' capacities, one more each, its share of them; None while fair share is off or no replica.
        capacity: the requests the replicas run at once, this process's share of them."""
        active = self.pool.active
        sized = self._sized
        if sized[0] is not active:
            kv = [self.pool.kv_tokens.get(b.url) for b in active]
            known = [k for k in kv if k is not None]
            budget = (None if self.share <= 0 or not kv or len(known) < len(kv)
                      else int(self.share * sum(known) / self.workers))
            slots = (None if self.fair is None or not active
                     else max(1, sum(b.capacity + 1 for b in active) // self.workers))
            sized = self._sized = (active, budget, slots, max(1, sum(b.capacity for b in active) // self.workers))
        return sized[1], sized[2], sized[3]

    def budget(self) -> int | None:
        return self.sizes()[0]

    def may_go(self, ticket: Ticket, slots: int | None, capacity: int, now: float) -> bool:
        """Whether the ticket's user may take a place now (always, without fair share)."""
        if slots is None or self.fair is None:
            return True
        return self.fair.may_go(ticket.project, ticket.user, self.admitted, capacity, slots, now)

    @asynccontextmanager
    async def turn(self, affinity: Affinity | None, project: str = "", user: str = "") -> AsyncIterator[Ticket]:
        """The request's turn: entered at once while there is room, else in its order; left at its end."""
        ticket = await self.enter(affinity, project, user)
        try:
            yield ticket
        finally:
            self.leave(ticket)

    async def enter(self, affinity: Affinity | None, project: str = "", user: str = "") -> Ticket:
        """Returns once the request may go on (it then holds its ticket until leave)."""
        now = time.monotonic()
        ticket = Ticket(affinity, now, project=project, user=user)
        budget, slots, capacity = self.sizes()
        priced = budget is not None and affinity is not None and bool(affinity.tokens)
        if not priced and slots is None:
            self.grant(ticket, 0)
            return ticket
        fair = self.fair
        if fair is not None:
            if now >= fair.due:
                fair.expire(now)
            if not priced and not self.waiting and self.admitted + RESERVE + fair.kept_most < capacity:
                # room to spare whoever asks (may_go's shortcut): at once, without the turns' bookkeeping
                fair.went(project, user, now)
                ticket.cost = 0
                self.admitted += 1
                return ticket
            fair.arrived(project, user, now)
        if not self.waiting and self.may_go(ticket, slots, capacity, now):
            cost = prefill_cost(self.pool, affinity, now)[0] if priced else 0
            if not priced or budget is None or self.admitted == 0 or self.in_flight + cost <= budget:
                self.grant(ticket, cost)
                return ticket
        if self.queue(ticket).done():  # a prefix held somewhere may go before those waiting
            return ticket
        if self.pausable:
            # requests queued in engines (a user alone had the extra places) take the first places freed
            self.pause_for(ticket, capacity, 1 + max(0, self.admitted - capacity))
        await self.wait(ticket, now)
        return ticket

    def queue(self, ticket: Ticket, first: bool = False) -> asyncio.Future:
        """The ticket in line (first: before every other), then in whom there is room for; its grant (done
        when that was the ticket)."""
        granted = ticket.granted = asyncio.get_running_loop().create_future()
        (self.waiting.appendleft if first else self.waiting.append)(ticket)
        self.admit()
        return granted

    async def wait(self, ticket: Ticket, since: float) -> None:
        """Until the queued ticket is granted; how long is observed for its project."""
        assert ticket.granted is not None, "only a queued ticket waits"
        self.waits += 1
        try:
            await ticket.granted
        except asyncio.CancelledError:  # the client left: its place goes, or what it was granted
            if ticket.granted.done() and not ticket.granted.cancelled():
                self.leave(ticket)
            elif ticket in self.waiting:
                self.waiting.remove(ticket)
            raise
        project = ticket.project or "-"
        histogram = self.waited.get(project)
        if histogram is None:
            histogram = self.waited[project] = wait_histogram()
        observe(histogram, time.monotonic() - since)

    def may_pause(self, ticket: Ticket, pause: Callable[[], bool]) -> None:
        """A stream under way that could pause for a user below their share: pause() closes it at its engine
        and says True, or says False where it cannot (then it is not asked again)."""
        if self.fair is not None and self.fair.pauses:
            who = (ticket.project, ticket.user)
            streams = self.pausable.get(who)
            if streams is None:
                streams = self.pausable[who] = {}
            streams[ticket] = pause

    def cannot_pause(self, ticket: Ticket) -> None:
        """The stream ended, or paused: no longer one to ask."""
        who = (ticket.project, ticket.user)
        streams = self.pausable.get(who)
        if streams is not None and streams.pop(ticket, None) is not None and not streams:
            del self.pausable[who]

    def pause_for(self, ticket: Ticket, capacity: int, count: int) -> None:
        """The waiting ticket's user is below their share: `count` streams of the users furthest above
        theirs pause, the newest that can. Each paused stream's place is given back at once (its engine frees
        it as the connection closes), so the waiting ticket has it before this returns (in admit)."""
        assert self.fair is not None, "streams are pausable only with fair share (may_pause)"
        while count > 0:
            whom = self.fair.pause_whom((ticket.project, ticket.user), capacity, self.pausable)
            if whom is None:
                return
            streams = self.pausable[whom]
            while streams:
                paused, pause = streams.popitem()  # the newest first: the least to prefill again
                if pause():
                    self.pauses += 1
                    count -= 1
                    self.leave(paused)
                    paused.out = True  # its turn's end gives nothing back again; resume queues it
                    break
            if not streams:
                self.pausable.pop(whom, None)

    async def resume(self, ticket: Ticket) -> None:
        """A paused stream (its place given back as it paused) waits for another, first among its user's
        requests; returns once it has one."""
        now = time.monotonic()
        if self.fair is not None:
            if now >= self.fair.due:
                self.fair.expire(now)
            self.fair.arrived(ticket.project, ticket.user, now)
        granted = self.queue(ticket, first=True)
        try:
            if not granted.done():
                await self.wait(ticket, now)
        finally:  # granted, even as its client left: held again, the turn's end leaves it; else held by nobody
            ticket.out = not (granted.done() and not granted.cancelled())

    def grant(self, ticket: Ticket, cost: int) -> None:
        if ticket.granted is not None:
            if ticket.granted.cancelled():  # its client left while it waited: nothing to charge
                return
            ticket.granted.set_result(None)
        ticket.cost = cost
        self.in_flight += cost
        self.admitted += 1
        if self.fair is not None:
            self.fair.served(ticket.project, ticket.user)

    def leave(self, ticket: Ticket) -> None:
        """The request ended (answered, failed, or its client left)."""
        if ticket.out:  # a paused stream's client left while it waited: its place was given back already
            return
        self.in_flight -= ticket.cost
        self.admitted -= 1
        if self.fair is not None:  # places are kept only where the pool was full (beyond its reserve)
            full = self.admitted + 1 + RESERVE >= self._sized[3]
            self.fair.ended(ticket.project, ticket.user, time.monotonic() if full else None)
        self.admit()

    def admit(self) -> None:
        """Let waiting requests in while there is room (also after the pool changed: the budget with it)."""
        while self.waiting:
            budget, slots, capacity = self.sizes()
            now = time.monotonic()
            if budget is None and slots is None:  # admission is off now: all go
                while self.waiting:
                    self.grant(self.waiting.popleft(), 0)
                return
            if slots is not None and self.admitted >= slots:
                return
            # with fair share, the requests of the (project, user) whose turn it is among those who may go
            # now; else all, oldest first
            turn = None
            if self.fair is not None:
                verdicts: dict[tuple[str, str], bool] = {}  # one per user: the same for all their requests
                allowed = []
                for waiting in self.waiting:
                    who = (waiting.project, waiting.user)
                    verdict = verdicts.get(who)
                    if verdict is None:
                        verdict = verdicts[who] = self.may_go(waiting, slots, capacity, now)
                    if verdict:
                        allowed.append(waiting)
                if not allowed:
                    return
                turn = self.fair.choose(allowed)
            candidates = (range(len(self.waiting)) if turn is None
                          else [i for i, t in enumerate(self.waiting) if (t.project, t.user) == turn])
            costs: list[tuple[int, bool, float]] = []  # computed as next_admitted reads them

            def each_cost(candidates: Sequence[int], budget: int | None, costs: list[tuple[int, bool, float]],
                          now: float) -> Iterator[tuple[int, bool, float]]:
                for index in candidates:
                    ticket = self.waiting[index]
                    priced = budget is not None and ticket.affinity is not None and ticket.affinity.tokens
                    costs.append((*prefill_cost(self.pool, ticket.affinity, now), ticket.since) if priced
                                 else (0, False, ticket.since))
                    yield costs[-1]

            room = budget - self.in_flight if budget is not None else 2**62
            pick = next_admitted(each_cost(candidates, budget, costs, now), room, self.admitted == 0, now)
            if pick is None:
                return
            ticket = self.waiting[candidates[pick]]
            del self.waiting[candidates[pick]]
            self.grant(ticket, costs[pick][0])
