"""The data plane's routing state: the backends the controller wants (RoutingTable: active ones in its
order, retired ones until their requests end, the hash ring, and the indexes of what each replica's prefix
cache holds), what a request routes on (Affinity), and the cache queries the policies and admission share
(cached_share, cache_fill, record). No I/O; it runs for every request, so every step is a few list passes.

    pool = RoutingTable()
    pool.update([BackendSpec("http://10.0.0.5:8001", capacity=256)])   # the controller's desired set
    backend = routing.choose(pool, Routing.LEAST_LOADED, None, now=time.monotonic())   # None: none eligible

The policies that choose among its backends are routing/'s other modules (routing/__init__.py).
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field

from hpcserve.endpoint.dataplane.routing.prefix_index import TOKENS_PER_BLOCK, PrefixIndex
from hpcserve.endpoint.dataplane.routing.token_index import TokenIndex, token_blocks
from hpcserve.endpoint.protocol import BackendSpec

VIRTUAL_NODES = 64  # points per backend on the hash ring: shares within a few percent of equal
# A cached part worth following: half the prompt (SGLang's cache-aware router uses the same 0.5), so a
# short shared system prompt before long distinct questions does not pull every request to one replica.
MATCH_FRACTION = 0.5
# A prompt sent to a replica is in its cache before its engine says so: the events come once its prefill
# ran, which under load takes seconds (TTFT p99 ~5 s on an H100 at 128 in flight, benchmarks/results/routing.md).
# Its blocks count as held there this long at most, or until the engine stores them (token_index.expect).
PENDING_S = 15.0


@dataclass(slots=True)
class Affinity:
    """What the prefix policy routes on: a client's session header, the prompt's chained blocks of text
    (prefix_index), and its token ids where the data plane computes them (prompt_tokens)."""

    session: bytes | None = None
    blocks: tuple[int, ...] | list[int] = ()
    tokens: list[int] | None = None
    by_size: dict[int, list[int]] = field(default_factory=dict)  # token blocks per block size, made once

    @property
    def has_prompt(self) -> bool:
        """Whether there is a prompt to route by (and to record where it went)."""
        return bool(self.blocks or self.tokens)

    def token_blocks(self, size: int) -> list[int]:
        blocks = self.by_size.get(size)
        if blocks is None:
            blocks = self.by_size[size] = token_blocks(self.tokens or [], size)
        return blocks


@dataclass(slots=True, eq=False)
class Backend:
    """A backend in the data plane: the controller's settings and what the data plane counts."""

    url: str
    capacity: int
    saturated: bool = False
    in_flight: int = 0  # requests sent there whose response has not ended
    failed_until: float = 0.0  # monotonic time; skipped until then after a connection error
    requests: int = 0  # requests sent there since it joined
    failures: int = 0  # connection errors
    handing_over: bool = False  # drained: its streams move to other backends (endpoint/dataplane/streams.py)

    def load(self) -> float:
        return self.in_flight / self.capacity


class Ring:
    """Consistent hashing: VIRTUAL_NODES points per backend on a 64-bit circle. A key belongs to the
    first point at or after its own; adding or removing a backend moves only the keys of its points."""

    def __init__(self, backends: list[Backend]):
        points = sorted((point(f"{b.url}#{i}".encode()), n) for n, b in enumerate(backends)
                        for i in range(VIRTUAL_NODES))
        self.points = [p for p, _ in points]
        self.owners = [backends[n] for _, n in points]

    def owner(self, key: bytes, candidates: list[Backend]) -> Backend | None:
        """The key's backend among candidates: walking the circle from the key's point, the first point
        whose backend is a candidate (a failed or saturated backend's keys go to their next neighbour)."""
        if not self.points:
            return None
        allowed = {id(b) for b in candidates}
        start = bisect.bisect_left(self.points, point(key))
        size = len(self.points)
        for step in range(size):
            backend = self.owners[(start + step) % size]
            if id(backend) in allowed:
                return backend
        return None


def point(data: bytes) -> int:
    """A stable 64-bit hash (the same in every process, unlike hash()): a restarted data plane sends a
    session to the same replica as before."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class RoutingTable:
    """The backends: active ones in the controller's order, and retired ones (removed while requests
    still ran there) until those requests end, so /backends can say when a removed backend drained."""

    def __init__(self) -> None:
        self.active: list[Backend] = []
        self.by_url: dict[str, Backend] = {}
        self.retired: dict[str, Backend] = {}
        self.ring = Ring([])
        self.index = PrefixIndex()
        self.exact: dict[str, TokenIndex] = {}  # backends whose KV events are followed now (kv_feed)
        self.kv_tokens: dict[str, int] = {}  # each backend's KV cache in tokens, where the controller knows it
        self.turn = 0  # advances with every choice: ties and round_robin go in turn

    def update(self, specs: list[BackendSpec]) -> bool:
        """Make the active set exactly `specs` (idempotent). Counters of backends that stay are kept; a
        removed backend with requests in flight is retired until they end. True when membership changed."""
        wanted = {spec.url: spec for spec in specs}
        if len(wanted) != len(specs):
            raise ValueError("a backend url appears twice")
        for url in [url for url in self.by_url if url not in wanted]:
            gone = self.by_url.pop(url)
            if gone.in_flight > 0:
                self.retired[url] = gone
        active = []
        for spec in specs:
            backend = self.by_url.get(spec.url)
            if backend is None:  # joins, or comes back before its drained requests ended: no longer drained
                backend = self.retired.pop(spec.url, None) or Backend(spec.url, spec.capacity)
                backend.handing_over = False
            backend.capacity, backend.saturated = spec.capacity, spec.saturated
            self.by_url[spec.url] = backend
            self.index.set_limit(spec.url, spec.kv_tokens)
            if spec.kv_tokens:
                self.kv_tokens[spec.url] = spec.kv_tokens
            active.append(backend)
        changed = [b.url for b in active] != [b.url for b in self.active]
        self.active = active
        self.index.keep_only(wanted)
        for url in [url for url in self.kv_tokens if url not in wanted]:
            del self.kv_tokens[url]
        if changed:
            self.ring = Ring(active)
        return changed

    def release(self, backend: Backend) -> None:
        """A request sent to backend ended."""
        backend.in_flight -= 1
        if backend.in_flight <= 0 and self.retired.get(backend.url) is backend:
            del self.retired[backend.url]

    def next_recovery(self, now: float) -> float | None:
        """When the first failed backend may be tried again (monotonic time); None when none is failed."""
        times = [b.failed_until for b in self.active if b.failed_until > now]
        return min(times) if times else None


def record(pool: RoutingTable, url: str, affinity: Affinity, now: float) -> None:
    """A prompt sent to url (here, or by another worker of the data plane): in both indexes."""
    pool.index.record(url, affinity.blocks)
    exact = pool.exact.get(url)
    if exact is not None and affinity.tokens:
        if exact.block_size:
            exact.expect(affinity.token_blocks(exact.block_size), now + PENDING_S)
        else:  # no event yet (the first burst): its blocks count once the engine's first event says their size
            exact.expect_early(affinity.tokens, now + PENDING_S)


def cached_share(pool: RoutingTable, url: str, affinity: Affinity, now: float) -> float:
    """The part of the prompt (0 to 1) that url's prefix cache holds. Exactly, from its engine's events
    (with what was just sent there and is on its way into the cache), when they cover everything sent
    there (the feed began before the first request); where they may not (the feed began later, or broke),
    the larger of that and what the prompts sent there say; the sent prompts alone for an engine without
    events (prefix_index)."""
    blocks = affinity.blocks
    approximate = pool.index.match(url, blocks) / len(blocks) if blocks else 0.0
    exact = pool.exact.get(url)
    if exact is None or not exact.block_size or affinity.tokens is None:
        return approximate
    token_blocks = affinity.token_blocks(exact.block_size)
    held = exact.match(token_blocks, now) / len(token_blocks) if token_blocks else 0.0
    return held if exact.complete else max(held, approximate)


def cache_fill(pool: RoutingTable, url: str, now: float) -> float:
    """How full url's prefix cache is (0 empty, 1 full): from its engine's events where followed and its
    size known, with the prompts on their way in (else new prefixes pile onto the replica whose events lag
    most, until its repeats outgrow it: seen on CPU, benchmarks/results/routing.md), else by the prompts sent
    there."""
    exact, kv_tokens = pool.exact.get(url), pool.kv_tokens.get(url)
    if exact is not None and exact.complete and kv_tokens:
        return min(1.0, exact.blocks(now) * (exact.block_size or TOKENS_PER_BLOCK) / kv_tokens)
    return pool.index.fill(url)
