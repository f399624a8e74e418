"""The pool: the backends (replicas) behind the router that may take traffic, their probes and load.

A replica joins after its member's driver saw a real completion and the endpoint probed it once more
(from the router's side of the network); it leaves after FAILED_PROBES_TO_LEAVE failed probes, when
its member's job ends, or when it is drained on purpose. Between the controller's rounds the
load-aware rotation (endpoint.rotation) keeps saturated backends out of the router's rotation.

Everything here is done for all backends at once, so that a round costs about the same at 4 and at
256 replicas (docs/benchmarks/scale.md): the probes and /metrics reads run concurrently (bounded, each
with its own timeout: endpoint.probe), joins and leaves of one round are one router.apply, and the
rotation reads busy backends five times a second but idle ones once (decisions.reads_due).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from hpcserve.endpoint.decisions import LoadSample, ProbeResult, reads_due, should_leave
from hpcserve.endpoint.probe import Prober
from hpcserve.endpoint.rotation import Rotation
from hpcserve.endpoint.router import Router
from hpcserve.engine.client import completion_probe
from hpcserve.engine.metrics import EngineLoad

PROBE_TIMEOUT_S = 1.0
ROTATION_S = 0.2  # the load-aware rotation between rounds (measured: docs/benchmarks/router.md)
HISTORY_SAMPLES = 600  # load samples kept for the autoscaler (about ten minutes at one a second)
JOIN_PROBES_AT_ONCE = 16  # real completions sent at once to joining replicas
JOIN_TIMEOUT_S = 60.0


class Pool:
    """backends: the pool now, in join order (the serving members' replicas: one source of truth)."""

    def __init__(self, router: Router, api_key: str | None, model: str, tick_s: float,
                 backends: Callable[[], list[str]]):
        self.router, self.api_key, self.model, self.tick_s = router, api_key, model, tick_s
        self.backends = backends
        self.probes: dict[str, list[ProbeResult]] = {}
        self.loads: dict[str, EngineLoad] = {}  # each backend's last /metrics figures
        self.last_read: dict[str, float] = {}  # when they were read (monotonic)
        self.history: list[LoadSample] = []  # waiting/running/finished per backend, about once a second
        self.rotation = Rotation(router)
        self.prober = Prober(api_key)

    # ------------------------------------------------------------ membership
    def join(self, urls: list[str]) -> dict[str, str]:
        """Probe each replica once more with a real completion (all at once), then give the ones that
        answered traffic, in one router change. Returns url -> why, for those that did not join."""
        def answer(url: str) -> str | None:
            try:
                completion_probe(url, self.model, self.api_key, timeout_s=JOIN_TIMEOUT_S)
                return None
            except Exception as exc:  # noqa: BLE001 - the reason goes to the member's error
                return f"probe from the endpoint failed: {type(exc).__name__}: {exc}"[:300]

        with ThreadPoolExecutor(min(JOIN_PROBES_AT_ONCE, max(1, len(urls)))) as pool:
            failed = {url: why for url, why in zip(urls, pool.map(answer, urls)) if why}
        ready = [url for url in urls if url not in failed]
        refused = self.router.apply(add=ready) if ready else set()
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
            for table in (self.probes, self.loads, self.last_read):
                table.pop(url, None)

    def answering(self) -> set[str]:
        """The backends whose last probe passed."""
        return {u for u in self.backends() if self.probes.get(u) and self.probes[u][-1].ok}

    def in_rotation(self) -> list[str]:
        return [u for u in self.backends() if u not in self.rotation.paused]

    # ------------------------------------------------------------ probes
    def probe_all(self) -> list[str]:
        """Probe every backend of the pool at once and remember the results; the backends that must
        leave (FAILED_PROBES_TO_LEAVE failed probes in a row). /metrics (the API process answers) and
        /health (vLLM: the engine core is alive); the load figures feed the autoscaler and the
        rotation. The real completion was sent when the replica joined."""
        urls = self.backends()
        results = self.prober.probe(urls, PROBE_TIMEOUT_S)
        now = time.monotonic()
        leaving = []
        for url, probed in results.items():
            recent = self.probes.setdefault(url, [])
            recent.append(ProbeResult(probed.ok, probed.detail))
            del recent[:-10]
            if probed.load is not None:
                self.loads[url], self.last_read[url] = probed.load, now
                self.record_load(url, probed.load)
            if should_leave(recent):
                leaving.append(url)
        return leaving

    def last_probe(self, url: str) -> ProbeResult | None:
        recent = self.probes.get(url)
        return recent[-1] if recent else None

    def record_load(self, url: str, load: EngineLoad) -> None:
        now = time.time()
        if not self.history or now - self.history[-1].time > self.tick_s / 2:
            self.history.append(LoadSample(now, {}, {}))
        self.history[-1].waiting[url] = load.waiting
        self.history[-1].running[url] = load.running
        if load.finished is not None:
            self.history[-1].finished[url] = load.finished
        del self.history[:-HISTORY_SAMPLES]

    # ------------------------------------------------------------ load-aware rotation
    def balance(self) -> None:
        """Each round, with the probes' figures."""
        self.rotation.update(self.backends(), self.answering(), self.loads)

    def rotate(self) -> None:
        """Between rounds, every ROTATION_S: the load of the answering backends that are due (busy ones
        each time, idle ones once a second), and the rotation updated. A slow replica then gets new
        requests about as fast as it finishes them (docs/endpoint.md)."""
        answering = self.answering()
        now = time.monotonic()
        due = reads_due(sorted(answering), self.loads, self.rotation.paused, self.last_read, now,
                        ROTATION_S, self.tick_s)
        for url, load in self.prober.loads(due, ROTATION_S).items():
            if load is not None:
                self.loads[url], self.last_read[url] = load, now
        self.rotation.update(self.backends(), answering, self.loads)

    def busy(self, url: str) -> bool:
        """Requests still run or wait on it (a dead engine has nothing left to drain)."""
        load = self.router.engine_load(url)
        return load is not None and load.in_flight > 0

    def close(self) -> None:
        self.prober.close()
