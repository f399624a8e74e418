"""The pool: the backends (replicas) behind the router that may take traffic, their probes and load.

A replica joins after its member's driver saw a real completion and the endpoint probed it once more
(from the router's side of the network); it leaves after FAILED_PROBES_TO_LEAVE failed probes (after
SLOW_PROBES_TO_LEAVE if they only answered late: a busy engine; skipped for new requests meanwhile), when
its member's job ends, or when it is drained on purpose. Between the controller's rounds the
load-aware rotation (endpoint.control.rotation) marks backends whose engine queues as saturated in the data plane.

A round costs about the same at 4 and at 256 replicas (benchmarks/results/scale.md): probes and /metrics
reads run on the prober's event loop (bounded, each with its own timeout: endpoint.control.probe), started in
steps five times a second and spread over the second (decisions.probes_due), busy backends read every
step and idle ones once a second (decisions.reads_due); the controller's loop takes the results in
and never waits on a probe. Joins and leaves of one round are one router.apply each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from hpcserve.endpoint.control.decisions import (
    SLOW_PROBES_TO_LEAVE,
    LoadSample,
    ProbeResult,
    is_suspect,
    probes_due,
    reads_due,
    should_leave,
)
from hpcserve.endpoint.control.plane_client import Router
from hpcserve.endpoint.control.probe import ProbeKind, Prober, Result
from hpcserve.endpoint.control.rotation import Rotation
from hpcserve.engine.client import completion_probe, kv_cache_size
from hpcserve.engine.metrics import EngineLoad

PROBE_TIMEOUT_S = 1.0
ROTATION_S = 0.2  # the load-aware rotation between rounds (measured: benchmarks/results/router.md)
HISTORY_SAMPLES = 600  # load samples kept for the autoscaler (about ten minutes at one a second)
JOIN_PROBES_AT_ONCE = 16  # real completions sent at once to joining replicas
JOIN_TIMEOUT_S = 60.0
READ_WAIT_S = 0.1  # how long a rotation step waits for its /metrics reads (the rest: next step)


class Pool:
    """backends: the pool now, in join order (the serving members' replicas: one source of truth)."""

    def __init__(self, router: Router, api_key: str | None, model: str, tick_s: float,
                 backends: Callable[[], list[str]]):
        self.router, self.api_key, self.model, self.tick_s = router, api_key, model, tick_s
        self.backends = backends
        self.probes: dict[str, list[ProbeResult]] = {}
        self.loads: dict[str, EngineLoad] = {}  # each backend's last /metrics figures
        self.last_read: dict[str, float] = {}  # when they were read (monotonic)
        self.probe_started: dict[str, float] = {}  # when each backend's last probe was started
        self.last_step = 0.0
        self.history: list[LoadSample] = []  # waiting/running/finished per backend, about once a second
        self.rotation = Rotation(router)
        self.prober = Prober(api_key)

    # ------------------------------------------------------------ membership
    def join(self, urls: list[str], capacities: dict[str, int] | None = None) -> dict[str, str]:
        """Probe each replica once more with a real completion (all at once), then give the ones that
        answered traffic in proportion to their capacities (the requests each engine runs at once), in one router
        change. Returns url -> why, for those that did not join."""
        def answer(url: str) -> str | None:
            try:
                completion_probe(url, self.model, self.api_key, timeout_s=JOIN_TIMEOUT_S)
                return None
            except Exception as exc:  # noqa: BLE001 - the reason goes to the member's error
                return f"probe from the endpoint failed: {type(exc).__name__}: {exc}"[:300]

        with ThreadPoolExecutor(min(JOIN_PROBES_AT_ONCE, max(1, len(urls)))) as pool:
            failed = {url: why for url, why in zip(urls, pool.map(answer, urls)) if why}
            ready = [url for url in urls if url not in failed]
            # The engines' KV cache sizes: the data plane bounds its index and admits prefills by them.
            sizes = dict(zip(ready, pool.map(lambda url: kv_cache_size(url, self.api_key), ready)))
        refused = self.router.apply(add=ready, capacities=capacities, kv_tokens=sizes) if ready else set()
        failed |= {url: "the router did not take it (see its log)" for url in refused}
        for url in ready:
            if url not in refused:
                self.probes[url] = []
        return failed

    def leave(self, urls: list[str]) -> None:
        """Out of the pool for good, in one router change (a paused backend is out of the router already,
        but still counted). The controller waits for a drain itself, not blocking here."""
        if urls:
            self.router.apply(remove=urls)
        for url in urls:
            self.rotation.paused.discard(url)
            for table in (self.probes, self.loads, self.last_read, self.probe_started):
                table.pop(url, None)

    def answering(self) -> set[str]:
        """The backends whose last probe passed."""
        return {u for u in self.backends() if self.probes.get(u) and self.probes[u][-1].ok}

    def in_rotation(self) -> list[str]:
        """Every backend of the pool: a saturated one stays in the data plane, skipped there while
        another has room."""
        return self.backends()

    # ------------------------------------------------------------ probes and reads
    def step(self, wait_for_reads_s: float = 0.0) -> None:
        """One step of the probing, every ROTATION_S (and each round): the results that came in since
        the last step are taken in, then the probes due (each backend once a second, spread over the
        second: decisions.probes_due) and the /metrics reads due (busy backends every step, idle ones
        once a second: decisions.reads_due) are started. The network is the prober's: the loop waits
        for this step's reads up to wait_for_reads_s (the rotation wants fresh figures), never for
        probes (a silent replica takes its whole timeout)."""
        self.absorb(self.prober.collect())
        now = time.monotonic()
        elapsed = max(ROTATION_S, now - self.last_step) if self.last_step else ROTATION_S
        self.last_step = now
        backends = self.backends()
        probes = probes_due(backends, self.probe_started, now, self.tick_s, elapsed)
        reads = [url for url in reads_due(sorted(self.answering()), self.loads, self.rotation.paused, self.last_read,
                                          now, ROTATION_S, self.tick_s) if url not in probes]
        for url in probes:
            self.probe_started[url] = now
        batch = self.prober.start(probes, reads, PROBE_TIMEOUT_S, ROTATION_S)
        if reads and wait_for_reads_s:
            try:
                batch.result(timeout=wait_for_reads_s)
            except FutureTimeout:
                pass
        self.absorb(self.prober.collect())

    def absorb(self, results: list[Result]) -> None:
        """Probe and read results into the pool's tables (those of backends that left are dropped; a backend
        that serves without having joined here, one an adopting controller took over, gets its table)."""
        current = set(self.backends()) if results else set()
        for result in results:
            if result.url not in self.probes and result.url not in current:
                continue
            self.probes.setdefault(result.url, [])
            if result.probed.load is not None:
                self.loads[result.url], self.last_read[result.url] = result.probed.load, result.finished
            if result.kind is ProbeKind.PROBE:
                recent = self.probes[result.url]
                recent.append(ProbeResult(result.probed.ok, result.probed.detail, result.probed.late))
                del recent[:-SLOW_PROBES_TO_LEAVE]

    def leaving(self) -> list[str]:
        """The backends that must leave (decisions.should_leave)."""
        return [url for url in self.backends() if should_leave(self.probes.get(url, []))]

    def suspect(self) -> set[str]:
        """The backends that answer too late (decisions.is_suspect): skipped for new requests meanwhile."""
        return {url for url in self.backends() if is_suspect(self.probes.get(url, []))}

    def record_sample(self, queued: int = 0) -> None:
        """Every backend's last known load as one sample, once a round, for the autoscaler; queued: the
        requests the data plane keeps waiting for the model."""
        backends = [url for url in self.backends() if url in self.loads]
        if not backends:
            return
        loads = {url: self.loads[url] for url in backends}
        finished = {url: load.finished for url, load in loads.items() if load.finished is not None}
        self.history.append(LoadSample(time.time(), {u: ld.waiting for u, ld in loads.items()},
                                       {u: ld.running for u, ld in loads.items()}, finished, queued))
        del self.history[:-HISTORY_SAMPLES]

    # ------------------------------------------------------------ load-aware rotation
    def balance(self) -> None:
        """Each round, with the figures known."""
        self._mark_saturated()

    def rotate(self) -> None:
        """Between rounds, every ROTATION_S: a probing step that waits a little for this step's reads,
        and the rotation updated with them. A slow replica then gets new requests about as fast as it
        finishes them (docs/endpoint.md)."""
        self.step(wait_for_reads_s=READ_WAIT_S)
        self._mark_saturated()

    def _mark_saturated(self) -> None:
        self.rotation.update(self.backends(), self.answering(), self.loads, self.suspect())

    def close(self) -> None:
        self.prober.close()
