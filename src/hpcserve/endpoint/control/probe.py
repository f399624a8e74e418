"""Many replicas probed at once: /health and /metrics of every backend, concurrently and bounded.

One probe after the other cost the controller a round of N x (two requests + a parse of vLLM's 50 KB
/metrics page), and one silent replica (a dead node: no answer, no refusal) held the whole round for
its timeout. Here the requests of one round run together on an event loop of their own (a thread),
at most MAX_IN_FLIGHT at a time, each with its own timeout, so a round takes about as long as its
slowest replica, not the sum of them (measured: benchmarks/results/scale.md).

    prober = Prober(api_key)
    results = prober.probe(urls, timeout_s=1.0)     # url -> Probed (health and load), waiting for all
    loads = prober.loads(urls, timeout_s=0.2)       # url -> EngineLoad | None
    batch = prober.start(probe_urls, read_urls, 1.0, 0.2)   # returns at once (the controller's way)
    prober.collect()                                 # [Result] finished since the last call
    prober.close()
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

import aiohttp

from hpcserve.core.keys import bearer
from hpcserve.engine.metrics import EngineLoad, engine_load

MAX_IN_FLIGHT = 64  # requests at once: enough for 256 replicas in a few tens of ms, few enough for a login node
T = TypeVar("T")


@dataclass(frozen=True)
class Probed:
    """One backend's probe: did /health and /metrics answer 200, and its load (None if not)."""

    ok: bool
    detail: str = ""
    load: EngineLoad | None = None
    late: bool = False  # connected but no answer in time (a read timeout): a busy or frozen engine


def per_operation(timeout_s: float) -> aiohttp.ClientTimeout:
    """Per operation, not in total (as httpx's timeout): a dead node fails its connect and a hung engine
    its first read within timeout_s, while a busy engine that answers slowly but steadily is not taken
    for dead (a total of 1 s removed a loaded replica from the pool)."""
    return aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)


def failure(exc: BaseException) -> Probed:
    return Probed(False, f"{type(exc).__name__}: {exc}"[:200], late=isinstance(exc, aiohttp.SocketTimeoutError))


class ProbeKind(StrEnum):
    PROBE = "probe"  # /health and /metrics: is it alive (and its load)
    READ = "read"  # /metrics alone: its load, for the rotation


@dataclass(frozen=True)
class Result:
    url: str
    kind: ProbeKind
    probed: Probed
    finished: float  # time.monotonic()


class Prober:
    """An event loop in a thread of its own, one HTTP session (keep-alive connections to every backend)
    for /metrics, and a fresh connection for every /health: on a kept connection a dead node's silence
    reads as an engine answering late (decisions.SLOW_PROBES_TO_LEAVE), on a new one its connect fails."""

    def __init__(self, api_key: str | None, max_in_flight: int = MAX_IN_FLIGHT):
        self.headers = bearer(api_key)
        self.max_in_flight = max_in_flight
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="prober", daemon=True)
        self.thread.start()
        self.in_flight: set[tuple[str, ProbeKind]] = set()  # touched by the loop's thread only
        self.done: deque[Result] = deque()  # appended by the loop's thread, emptied by collect()
        self.session, self.fresh, self.slots = self._run(self._open())

    async def _open(self) -> tuple[aiohttp.ClientSession, aiohttp.ClientSession, asyncio.Semaphore]:
        # The semaphore bounds requests at once; a request's timeout starts once it holds a slot (a
        # connector limit would count the wait for a connection into the timeout: under many silent
        # replicas, healthy ones would time out waiting). trust_env off: never through a proxy.
        kept = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        fresh = aiohttp.TCPConnector(limit=0, force_close=True)
        return (aiohttp.ClientSession(connector=kept, trust_env=False),
                aiohttp.ClientSession(connector=fresh, trust_env=False), asyncio.Semaphore(self.max_in_flight))

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    # -------------------------------------------------------------- the probes
    def probe(self, urls: list[str], timeout_s: float) -> dict[str, Probed]:
        """/health and /metrics of each backend, all at once; waits for all of them."""
        return self._run(self._many(self._probe_one, urls, timeout_s), timeout_s * 4 + 5)

    def loads(self, urls: list[str], timeout_s: float) -> dict[str, EngineLoad | None]:
        """/metrics of each backend, all at once; None for those that did not answer in time."""
        probed = self._run(self._many(self._load_one, urls, timeout_s), timeout_s * 4 + 5)
        return {url: p.load for url, p in probed.items()}

    async def _many(self, one, urls: list[str], timeout_s: float) -> dict[str, Probed]:
        results = await asyncio.gather(*(one(url, per_operation(timeout_s)) for url in urls))
        return dict(zip(urls, results))

    def start(self, probes: list[str], reads: list[str], probe_timeout_s: float, read_timeout_s: float) -> Future:
        """Start probes (/health and /metrics) and reads (/metrics) and return at once: the controller's
        loop never waits on the network. A backend whose probe (or read) is still in flight is not
        asked again. The returned future is done when this batch's reads are (probes may take their
        whole timeout: a silent replica); every result arrives through collect()."""
        return asyncio.run_coroutine_threadsafe(self._batch(probes, reads, probe_timeout_s, read_timeout_s), self.loop)

    def collect(self) -> list[Result]:
        """Results finished since the last call, oldest first."""
        out = []
        while self.done:
            out.append(self.done.popleft())
        return out

    async def _batch(self, probes: list[str], reads: list[str], probe_timeout_s: float, read_timeout_s: float) -> None:
        for url in probes:
            self._launch(url, ProbeKind.PROBE, self._probe_one, probe_timeout_s)
        waited = [self._launch(url, ProbeKind.READ, self._load_one, read_timeout_s) for url in reads]
        await asyncio.gather(*(task for task in waited if task is not None))

    def _launch(self, url: str, kind: ProbeKind, one, timeout_s: float) -> asyncio.Task | None:
        if (url, kind) in self.in_flight:
            return None
        self.in_flight.add((url, kind))

        async def run() -> None:
            try:
                probed = await one(url, per_operation(timeout_s))
            finally:
                self.in_flight.discard((url, kind))
            self.done.append(Result(url, kind, probed, time.monotonic()))

        return self.loop.create_task(run())

    async def _get(self, url: str, timeout: aiohttp.ClientTimeout, session: aiohttp.ClientSession | None = None
                   ) -> tuple[int, str]:
        async with self.slots, (session or self.session).get(url, headers=self.headers, timeout=timeout) as response:
            return response.status, await response.text()

    async def _probe_one(self, url: str, timeout: aiohttp.ClientTimeout) -> Probed:
        health, metrics = await asyncio.gather(self._get(f"{url}/health", timeout, self.fresh),
                                               self._get(f"{url}/metrics", timeout), return_exceptions=True)
        if isinstance(health, BaseException) or isinstance(metrics, BaseException):
            errors = [r for r in (health, metrics) if isinstance(r, BaseException)]
            unexpected = [e for e in errors if not isinstance(e, aiohttp.ClientError | asyncio.TimeoutError)]
            if unexpected:
                raise unexpected[0]
            # Late only if everything that failed was late (a refused /health is a dead engine)
            first = min(errors, key=lambda e: isinstance(e, aiohttp.SocketTimeoutError))
            return failure(first)
        if health[0] != 200 or metrics[0] != 200:
            return Probed(False, f"/health {health[0]}, /metrics {metrics[0]}")
        return parsed(metrics[1])

    async def _load_one(self, url: str, timeout: aiohttp.ClientTimeout) -> Probed:
        try:
            status, text = await self._get(f"{url}/metrics", timeout)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return failure(exc)
        return parsed(text) if status == 200 else Probed(False, f"/metrics {status}")

    def close(self) -> None:
        try:
            self._run(self.session.close(), 5)
            self._run(self.fresh.close(), 5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)


def parsed(metrics_text: str) -> Probed:
    try:
        return Probed(True, load=engine_load(metrics_text))
    except ValueError as exc:
        return Probed(False, f"/metrics is not Prometheus text: {exc}")
