"""The pool: the backends (replicas) behind the router that may take traffic, their probes and load.

A replica joins after its member's driver saw a real completion and the endpoint probed it once more
(from the router's side of the network); it leaves after FAILED_PROBES_TO_LEAVE failed probes, when
its member's job ends, or when it is drained on purpose. Between the controller's rounds the
load-aware rotation (endpoint.rotation) marks backends whose engine queues as saturated in the data plane.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from hpcserve.core.keys import bearer
from hpcserve.endpoint.decisions import LoadSample, ProbeResult, should_leave
from hpcserve.endpoint.rotation import Rotation
from hpcserve.endpoint.router import Router
from hpcserve.engine.client import completion_probe
from hpcserve.engine.metrics import EngineLoad, engine_load

PROBE_TIMEOUT_S = 1.0
ROTATION_S = 0.2  # the load-aware rotation between rounds (measured: docs/benchmarks/router.md)
HISTORY_SAMPLES = 600  # load samples kept for the autoscaler (about ten minutes at one a second)


class Pool:
    """backends: the pool now, in join order (the serving members' replicas: one source of truth)."""

    def __init__(self, router: Router, api_key: str | None, model: str, tick_s: float,
                 backends: Callable[[], list[str]]):
        self.router, self.api_key, self.model, self.tick_s = router, api_key, model, tick_s
        self.backends = backends
        self.probes: dict[str, list[ProbeResult]] = {}
        self.loads: dict[str, EngineLoad] = {}  # each backend's last /metrics figures
        self.history: list[LoadSample] = []  # waiting/running/finished per backend, about once a second
        self.rotation = Rotation(router)
        self.client = httpx.Client(timeout=PROBE_TIMEOUT_S, trust_env=False)

    # ------------------------------------------------------------ membership
    def join(self, urls: list[str], capacity: int | None = None) -> None:
        """Probe each replica once more with a real completion, then give it traffic in proportion to
        capacity (the requests its engine runs at once)."""
        for url in urls:
            completion_probe(url, self.model, self.api_key, timeout_s=60)
        for url in urls:
            self.router.add(url, capacity)
            self.probes[url] = []

    def leave(self, url: str) -> None:
        """Out of the pool for good."""
        if url in (b.url for b in self.router.backends()):
            self.router.remove(url, drain_s=0)  # the controller waits for a drain itself, not blocking
        self.rotation.paused.discard(url)
        for table in (self.probes, self.loads):
            table.pop(url, None)

    def answering(self) -> set[str]:
        """The backends whose last probe passed."""
        return {u for u in self.backends() if self.probes.get(u) and self.probes[u][-1].ok}

    def in_rotation(self) -> list[str]:
        """Every backend of the pool: a saturated one stays in the data plane, skipped there while
        another has room."""
        return self.backends()

    # ------------------------------------------------------------ probes
    def probe(self, url: str) -> bool:
        """Probe one backend and remember the result; True when it must leave (failed probes in a row)."""
        result = self._probe(url)
        recent = self.probes.setdefault(url, [])
        recent.append(result)
        del recent[:-10]
        return should_leave(recent)

    def last_probe(self, url: str) -> ProbeResult | None:
        recent = self.probes.get(url)
        return recent[-1] if recent else None

    def _probe(self, url: str) -> ProbeResult:
        """/metrics (the API process answers) and /health (vLLM: the engine core is alive); the load
        figures feed the autoscaler. The real completion was sent when the replica joined."""
        try:
            health = self.client.get(f"{url}/health")
            metrics = self.client.get(f"{url}/metrics", headers=bearer(self.api_key))
        except httpx.HTTPError as exc:
            return ProbeResult(False, f"{type(exc).__name__}: {exc}"[:200])
        if health.status_code != 200 or metrics.status_code != 200:
            return ProbeResult(False, f"/health {health.status_code}, /metrics {metrics.status_code}")
        try:
            load = self.loads[url] = engine_load(metrics.text)
        except ValueError as exc:
            return ProbeResult(False, f"/metrics is not Prometheus text: {exc}")
        self.record_load(url, load)
        return ProbeResult(True)

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
        """Between rounds, every ROTATION_S: the answering backends' load again, and the rotation updated.
        A slow replica then gets new requests about as fast as it finishes them (docs/endpoint.md)."""
        answering = self.answering()
        for url in answering:
            load = self.router.engine_load(url, timeout_s=ROTATION_S)
            if load is not None:
                self.loads[url] = load
        self.rotation.update(self.backends(), answering, self.loads)

    def busy(self, url: str) -> bool:
        """Requests still run or wait on it (a dead engine has nothing left to drain)."""
        load = self.router.engine_load(url)
        return load is not None and load.in_flight > 0
