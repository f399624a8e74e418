"""Tenancy on the data plane's hot path: who a request's key belongs to, whether it is within its limits, and
its usage row, all from memory. A thread of its own (one per data-plane worker) keeps that memory in step
with the store (store.py) and writes the usage rows, batched: no request waits on the database.

Every poll_s the thread (1) writes the usage rows that ended since its last write, when usage_flush_s has
passed, (2) reloads the keys when the store's revision moved (a key added or revoked on any host is in
effect here within poll_s plus one read), (3) reads the last two minutes' counts of every key, and, on the
event loop, swaps in what it read and takes the rows it wrote out of this worker's own counts: so a
request is counted once, here until its row is written, in the store after.

What the limits see: this worker's requests at once, other workers' (and other hosts') once their rows
are written, at most usage_flush_s + poll_s later. What a killed worker loses: its rows not yet written,
at most usage_flush_s of its requests (docs/tenancy.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from hashlib import blake2b

from hpcserve.core.keys import KeyCheck, bearer_token
from hpcserve.tenancy.limits import DAY_S, LimitHit, Window, cap_hit, rate_hit
from hpcserve.tenancy.records import OWNER_KEY_ID, KeyRecord, Limits, UsageRow, matches, split_key
from hpcserve.tenancy.store import Store

log = logging.getLogger(__name__)

POLL_S = 0.5
OWNER = "owner"


@dataclass(frozen=True)
class Tenant:
    """Who sent a request, as its key says."""

    key_id: str
    user: str
    project: str | None
    limits: Limits
    models: tuple[str, ...] | None = None
    rated: bool = True  # limited by a rate (the owner's key never is)
    capped: bool = True  # some cap on what one request asks for (n, best_of, max_tokens)
    expires_at: float | None = None  # epoch seconds: the key's expiry (a remembered check ends there)

    def allows_model(self, model: str | None) -> bool:
        return self.models is None or model in self.models


@dataclass
class _Counts:
    requests: int = 0
    tokens: int = 0


class Tally(Window):
    """A key's Window as of one epoch minute, as running sums: made at the key's first request of the minute (or
    its first after the thread swapped the stored counts) from the stored counts and this worker's own, then moved
    on by each of the key's requests as it starts and ends, so that a request reads its window rather than sums
    it. `own` is this worker's counts of the key's minute (the Meter's, shared; None until the minute has one, so
    that a window looked at for a refused request leaves no empty counts behind): a request of the minute counts
    there without looking it up."""

    __slots__ = ("day_start", "minute", "own")

    def __init__(self, minute: int, own: _Counts | None):
        super().__init__()
        self.minute, self.day_start, self.own = minute, minute - minute % DAY_MINUTES, own

    def add(self, minute: int, requests: int, tokens: int) -> None:
        """Requests and tokens of an epoch minute, counted where the window sees them (its minute, the one
        before, the day)."""
        if minute == self.minute:
            self.requests += requests
            self.tokens += tokens
        elif minute == self.minute - 1:
            self.previous_requests += requests
            self.previous_tokens += tokens
        if minute >= self.day_start:
            self.day_tokens += tokens


@dataclass
class Meter:
    """Per key and epoch minute: what the store holds (read by the thread) plus this worker's own requests not
    yet written there (per key: a request looks at its own key's few minutes only). Only the event loop
    touches it."""

    stored: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)  # the last two minutes, read
    stored_day: dict[str, int] = field(default_factory=dict)  # tokens of today's minutes before those two
    own: dict[str, dict[int, _Counts]] = field(default_factory=dict)
    # per key, its window (stored + own) as running sums; all dropped whenever `stored` or `own` change at once
    windows: dict[str, Tally] = field(default_factory=dict)

    def _own(self, key_id: str, minute: int) -> _Counts:
        minutes = self.own.get(key_id)
        if minutes is None:
            minutes = self.own[key_id] = {}
        counts = minutes.get(minute)
        if counts is None:
            counts = minutes[minute] = _Counts()
        return counts

    def began(self, key_id: str, minute: int) -> None:
        """A request of this epoch minute (TenantView.admit counts a rated key's through its window at once)."""
        tally = self.windows.get(key_id)
        if tally is not None and tally.minute == minute:
            if tally.own is None:
                tally.own = self._own(key_id, minute)
            tally.own.requests += 1
            tally.requests += 1
            return
        self._own(key_id, minute).requests += 1
        if tally is not None:
            tally.add(minute, 1, 0)

    def ended(self, key_id: str, minute: int, tokens: int) -> None:
        """The tokens of a request that began in this epoch minute."""
        if not tokens:
            return
        tally = self.windows.get(key_id)
        if tally is not None and tally.minute == minute and tally.own is not None:
            tally.own.tokens += tokens
            tally.tokens += tokens
            tally.day_tokens += tokens
            return
        self._own(key_id, minute).tokens += tokens
        if tally is not None:
            tally.add(minute, 0, tokens)

    def swap(self, stored: dict[str, dict[int, tuple[int, int]]], stored_day: dict[str, int] | None) -> None:
        self.stored = stored
        if stored_day is not None:
            self.stored_day = stored_day
        self.windows = {}

    def written(self, counts: Iterable[tuple[str, int, int, int]]) -> None:
        """These (key id, minute, requests, tokens) are in the store now (and in `stored`, read after they
        were written)."""
        for key_id, minute, requests, tokens in counts:
            minutes = self.own.get(key_id)
            own = minutes.get(minute) if minutes is not None else None
            if minutes is None or own is None:
                continue
            own.requests -= requests
            own.tokens -= tokens
            if own.requests <= 0 and own.tokens <= 0:
                del minutes[minute]
                if not minutes:
                    del self.own[key_id]
        self.windows = {}  # a window's `own` may be gone from `own`

    def window(self, key_id: str, minute: int) -> Tally:
        """The key's counts for a request of this epoch minute."""
        tally = self.windows.get(key_id)
        if tally is None or tally.minute != minute:
            tally = self.windows[key_id] = self._tally(key_id, minute)
        return tally

    def _tally(self, key_id: str, minute: int) -> Tally:
        own = self.own.get(key_id, _NONE)
        tally = Tally(minute, own.get(minute))
        for at, (requests, tokens) in self.stored.get(key_id, _NONE).items():
            tally.add(at, requests, tokens)
        tally.day_tokens += self.stored_day.get(key_id, 0)
        for at, counts in own.items():
            tally.add(at, counts.requests, counts.tokens)
        return tally


_NONE: dict = {}
DAY_MINUTES = DAY_S // 60
# Authorization headers remembered as verified (by their keyed digest) at most; past it they are forgotten, all
# at once: only a key's holder can add one (a refused header is never remembered), by spelling the header anew.
MAX_VERIFIED = 65_536


def minute_of(epoch_s: float) -> int:
    return int(epoch_s // 60)


def capped(limits: Limits) -> bool:
    """Whether these limits cap what one request asks for (else a request's JSON needs no look for them)."""
    return limits.max_n is not None or limits.max_best_of is not None or limits.max_tokens is not None


class TenantView:
    """The keys, the meter and the rows to write, for one data-plane worker. `identify`, `admit` and `ended` run
    on the event loop and never block; `start` begins the thread that talks to the store.

    Verified keys are remembered, so that a key's next request skips its salted hash: by a BLAKE2b digest of the
    whole Authorization header keyed with this process's own random key, never by the header itself (no secret
    is kept beyond the request that carries it, and the digests are no more use to one who reads this process's
    memory than the store's salted hashes, against 256-bit secrets). Only a header that passed the full check is
    remembered, so a wrong guess always takes the full, constant-time check; finding a remembered digest takes
    a time that depends on the digest alone, which without the process's key says nothing of any secret. The
    memory is dropped whenever the keys are reloaded (a revoked key is refused as soon as the reload is in, as
    before), and a remembered key's expiry is checked at every request."""

    def __init__(self, open_store: Callable[[], Store], owner_key: str | None, base_limits: Limits,
                 flush_s: float = 1.0, poll_s: float = POLL_S, shares: dict[str, float] | None = None,
                 pause_streams: bool = True):
        """shares: projects' fair-share weights; pause_streams: streams of users above their share pause for
        users below (the data plane's admission reads both)."""
        self.open_store, self.base_limits, self.shares = open_store, base_limits, dict(shares or {})
        self.pause_streams = pause_streams
        self.owner = KeyCheck(owner_key) if owner_key else None
        self.owner_tenant = Tenant(OWNER_KEY_ID, OWNER, None, base_limits, rated=False, capped=capped(base_limits))
        self.flush_s, self.poll_s = flush_s, poll_s
        self.keys: dict[str, KeyRecord] = {}
        self.tenants: dict[str, Tenant] = {}  # per key id, its limits merged over the base ones once
        self.verified: dict[bytes, Tenant] = {}  # keyed digest of an Authorization header -> its tenant
        self._keyed = blake2b(key=secrets.token_bytes(32))  # this process's own key: digests mean nothing elsewhere
        self.meter = Meter()
        self.rows: deque[UsageRow] = deque()  # append here, popleft in the thread: both thread-safe
        self.loaded = threading.Event()  # the first read of the keys is done
        self.revision = -1
        self.written_rows = 0
        self.lost_rows = 0  # rows a failed write could not keep (counted, logged)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_flush = 0.0  # the thread's (monotonic): when it last wrote the rows
        self._day_before: int | None = None  # the thread's: the minute before which the day's tokens were summed

    # ------------------------------------------------------------------ the hot path (event loop)

    def identify(self, authorization: str | bytes | None, now: float) -> Tenant | None:
        """The tenant of this Authorization header, or None (no such key, revoked, expired): a 401."""
        if authorization is None:
            return None
        raw = authorization.encode("utf-8", "surrogateescape") if isinstance(authorization, str) else authorization
        keyed = self._keyed.copy()  # the key's block hashed once, at start: a copy skips it
        keyed.update(raw)
        digest = keyed.digest()
        tenant = self.verified.get(digest)
        if tenant is not None and (tenant.expires_at is None or now < tenant.expires_at):
            return tenant
        tenant = self._check(raw, now)
        if tenant is not None:
            if len(self.verified) >= MAX_VERIFIED:
                self.verified = {}
            self.verified[digest] = tenant
        return tenant

    def _check(self, authorization: bytes, now: float) -> Tenant | None:
        """The full check of a header: its key's salted hash compared in constant time."""
        token = bearer_token(authorization)
        if token is None:
            return None
        parts = split_key(token)
        if parts is None:  # not shaped like a user's key: the owner's, or nobody's
            return self.owner_tenant if self.owner is not None and self.owner.allows(authorization) else None
        key_id, secret = parts
        record = self.keys.get(key_id)
        # matches() first, for an unknown id too: a refusal takes as long either way
        if not matches(record, secret) or record is None or not record.usable(now):
            return None
        return self.tenants[key_id]

    def admit(self, tenant: Tenant, data: dict | None, now: float) -> LimitHit | None:
        """The limit this request passes (nothing counted), else None: then it is counted against its key."""
        if tenant.capped:
            hit = cap_hit(tenant.limits, data)
            if hit is not None:
                return hit
        minute = int(now // 60)  # the epoch minute (minute_of), inline on the hot path
        if not tenant.rated:
            self.meter.began(tenant.key_id, minute)
            return None
        window = self.meter.windows.get(tenant.key_id)
        if window is None or window.minute != minute:  # Meter.window's look, its call spared
            window = self.meter.window(tenant.key_id, minute)
        hit = rate_hit(tenant.limits, window, now)
        if hit is None:  # Meter.began, inline: the window is the key's of this minute
            own = window.own
            if own is None:
                own = window.own = self.meter._own(tenant.key_id, minute)
            own.requests += 1
            window.requests += 1
        return hit

    def tenant_of(self, record: KeyRecord) -> Tenant:
        limits = self.base_limits.merged(record.limits)
        rated = any(v is not None for v in (limits.requests_per_minute, limits.tokens_per_minute,
                                            limits.tokens_per_day))
        return Tenant(record.key_id, record.user, record.project, limits, record.models, rated, capped(limits),
                      record.expires_at)

    def ended(self, row: UsageRow) -> None:
        tokens = (row.prompt_tokens or 0) + (row.completion_tokens or 0)
        if tokens:
            self.meter.ended(row.key_id, int(row.started_at // 60), tokens)
        self.rows.append(row)

    # ------------------------------------------------------------------ the thread

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="tenancy", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """The rows not yet written are written now (at SIGTERM: a worker that stops loses none)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        store = None
        while True:
            stopping = self._stop.is_set()
            store = self.poll(store, stopping)
            if stopping:
                return
            self._stop.wait(self.poll_s)

    def poll(self, store: Store | None, stopping: bool = False) -> Store | None:
        """One round of the thread: the rows written (when flush_s has passed, or stopping), the keys reloaded
        when their revision moved, the recent counts read and handed to the event loop. Returns the store to use
        next time (None: closed, after an error or when stopping)."""
        try:
            if store is None:
                store = self.open_store()
            now = time.monotonic()
            written = []
            if stopping or now - self._last_flush >= self.flush_s:
                written = self._write(store)
                self._last_flush = now
            if stopping:
                store.close()
                return None
            keys = tenants = None
            revision = store.revision()
            if revision != self.revision:
                keys = {record.key_id: record for record in store.keys()}  # noqa: SIM118 - a Store, not a dict
                tenants = {key_id: self.tenant_of(record) for key_id, record in keys.items()}
                self.revision = revision
            wall = time.time()
            recent_since = minute_of(wall) - 1
            recent = store.window_counts(recent_since)
            day = None
            if self._day_before != recent_since:  # a new minute: the older ones are whole, summed once
                day_start = int(wall // DAY_S) * DAY_S // 60
                day = {key: sum(c.tokens for m, c in minutes.items() if m < recent_since)
                       for key, minutes in store.window_counts(day_start).items()}
                self._day_before = recent_since
            self._post(keys, tenants, recent, day, written)
            return store
        except Exception:  # the database may be away a while: serve on, try again
            log.exception("tenancy: the store could not be read or written; trying again in %g s", self.poll_s)
            if store is not None:
                with contextlib.suppress(Exception):  # its connection may be broken already
                    store.close()
            return None

    def _write(self, store: Store) -> list[tuple[str, int, int, int]]:
        """Writes the rows that ended; returns their counts per key and minute."""
        rows = []
        while self.rows:
            rows.append(self.rows.popleft())
        if not rows:
            return []
        try:
            counts = store.record_usage(rows)
        except Exception:
            self.rows.extendleft(reversed(rows))  # kept for the next try, oldest first
            raise
        self.written_rows += len(rows)
        return counts

    def _post(self, keys, tenants, recent, day, written) -> None:
        stored = {key: {m: (c.requests, c.tokens) for m, c in minutes.items()} for key, minutes in recent.items()}

        def apply() -> None:
            if keys is not None:  # the tenants first: a key identified is always found among them
                self.tenants, self.keys = tenants, keys
                self.verified = {}  # checked again against the keys as they are now (revoked, changed)
            self.meter.swap(stored, day)
            self.meter.written(written)
            self.loaded.set()

        if self._loop is None or self._loop.is_closed():
            apply()
        else:
            self._loop.call_soon_threadsafe(apply)
