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
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from hpcserve.core.keys import KeyCheck, bearer_token
from hpcserve.tenancy.limits import DAY_S, LimitHit, Window, cap_hit, rate_hit
from hpcserve.tenancy.records import OWNER_KEY_ID, KeyRecord, Limits, UsageRow, matches, split_key
from hpcserve.tenancy.store import Store
from hpcserve.tenancy.tables import minute_counts

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

    def allows_model(self, model: str | None) -> bool:
        return self.models is None or model in self.models


@dataclass
class _Counts:
    requests: int = 0
    tokens: int = 0


@dataclass
class Meter:
    """Per key and epoch minute: what the store holds (read by the thread) plus this worker's own requests not
    yet written there (per key: a request looks at its own key's few minutes only). Only the event loop
    touches it."""

    stored: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)  # the last two minutes, read
    stored_day: dict[str, int] = field(default_factory=dict)  # tokens of today's minutes before those two
    own: dict[str, dict[int, _Counts]] = field(default_factory=dict)
    # per key, the stored counts summed for one minute: (minute, previous requests, previous tokens, requests,
    # tokens, day tokens); made at a key's first request of a minute, dropped when the thread swaps `stored`
    bases: dict[str, tuple[int, int, int, int, int, int]] = field(default_factory=dict)

    def _own(self, key_id: str, minute: int) -> _Counts:
        minutes = self.own.get(key_id)
        if minutes is None:
            minutes = self.own[key_id] = {}
        counts = minutes.get(minute)
        if counts is None:
            counts = minutes[minute] = _Counts()
        return counts

    def began(self, key_id: str, minute: int) -> None:
        self._own(key_id, minute).requests += 1

    def ended(self, key_id: str, minute: int, tokens: int) -> None:
        self._own(key_id, minute).tokens += tokens

    def swap(self, stored: dict[str, dict[int, tuple[int, int]]], stored_day: dict[str, int] | None) -> None:
        self.stored = stored
        if stored_day is not None:
            self.stored_day = stored_day
        self.bases = {}

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

    def window(self, key_id: str, now: float) -> Window:
        minute = int(now // 60)
        base = self.bases.get(key_id)
        if base is None or base[0] != minute:
            base = self.bases[key_id] = self._base(key_id, minute)
        _, before_r, before_t, now_r, now_t, day_t = base
        own = self.own.get(key_id)
        if own is None:
            return Window(before_r, before_t, now_r, now_t, day_t)
        own_now, own_before = own.get(minute, _ZERO), own.get(minute - 1, _ZERO)
        day_start = minute - minute % (DAY_S // 60)
        own_day = 0
        for at, counts in own.items():
            if at >= day_start:
                own_day += counts.tokens
        return Window(before_r + own_before.requests, before_t + own_before.tokens, now_r + own_now.requests,
                      now_t + own_now.tokens, day_t + own_day)

    def _base(self, key_id: str, minute: int) -> tuple[int, int, int, int, int, int]:
        stored = self.stored.get(key_id, _NONE)
        now_r, now_t = stored.get(minute, (0, 0))
        before_r, before_t = stored.get(minute - 1, (0, 0))
        day_start = minute - minute % (DAY_S // 60)
        recent_day = sum(t for m, (_, t) in stored.items() if m >= day_start)
        return minute, before_r, before_t, now_r, now_t, self.stored_day.get(key_id, 0) + recent_day


_NONE: dict = {}
_ZERO = _Counts()


def minute_of(epoch_s: float) -> int:
    return int(epoch_s // 60)


def capped(limits: Limits) -> bool:
    """Whether these limits cap what one request asks for (else a request's JSON needs no look for them)."""
    return limits.max_n is not None or limits.max_best_of is not None or limits.max_tokens is not None


class TenantView:
    """The keys, the meter and the rows to write, for one data-plane worker. `identify`, `check`, `began` and
    `ended` run on the event loop and never block; `start` begins the thread that talks to the store."""

    def __init__(self, open_store: Callable[[], Store], owner_key: str | None, base_limits: Limits,
                 flush_s: float = 1.0, poll_s: float = POLL_S, shares: dict[str, float] | None = None):
        """shares: projects' fair-share weights (the data plane's admission reads them)."""
        self.open_store, self.base_limits, self.shares = open_store, base_limits, dict(shares or {})
        self.owner = KeyCheck(owner_key) if owner_key else None
        self.owner_tenant = Tenant(OWNER_KEY_ID, OWNER, None, base_limits, rated=False, capped=capped(base_limits))
        self.flush_s, self.poll_s = flush_s, poll_s
        self.keys: dict[str, KeyRecord] = {}
        self.tenants: dict[str, Tenant] = {}  # per key id, its limits merged over the base ones once
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

    def check(self, tenant: Tenant, data: dict | None, now: float) -> LimitHit | None:
        hit = cap_hit(tenant.limits, data) if tenant.capped else None
        if hit is None and tenant.rated:
            hit = rate_hit(tenant.limits, self.meter.window(tenant.key_id, now), now)
        return hit

    def tenant_of(self, record: KeyRecord) -> Tenant:
        limits = self.base_limits.merged(record.limits)
        rated = any(v is not None for v in (limits.requests_per_minute, limits.tokens_per_minute,
                                            limits.tokens_per_day))
        return Tenant(record.key_id, record.user, record.project, limits, record.models, rated, capped(limits))

    def began(self, tenant: Tenant, started_at: float) -> None:
        self.meter.began(tenant.key_id, int(started_at // 60))  # the epoch minute (minute_of), inline on the hot path

    def ended(self, row: UsageRow) -> None:
        self.meter.ended(row.key_id, int(row.started_at // 60), (row.prompt_tokens or 0) + (row.completion_tokens or 0))
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
            store.record_usage(rows)
        except Exception:
            self.rows.extendleft(reversed(rows))  # kept for the next try, oldest first
            raise
        self.written_rows += len(rows)
        return minute_counts(rows)

    def _post(self, keys, tenants, recent, day, written) -> None:
        stored = {key: {m: (c.requests, c.tokens) for m, c in minutes.items()} for key, minutes in recent.items()}

        def apply() -> None:
            if keys is not None:  # the tenants first: a key identified is always found among them
                self.tenants, self.keys = tenants, keys
            self.meter.swap(stored, day)
            self.meter.written(written)
            self.loaded.set()

        if self._loop is None or self._loop.is_closed():
            apply()
        else:
            self._loop.call_soon_threadsafe(apply)
