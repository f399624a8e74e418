"""A deployment's metrics, gathered now: every replica's vLLM /metrics plus every node's latest sample.

    Gatherer(name).snapshot()   one Snapshot: deployment status, replicas (up, queue, tokens/s, KV cache),
                                nodes (latest sample, short history); cached ~1 s so that the dashboard,
                                Prometheus and `status --watch` polling together scrape vLLM once
(monitoring/prometheus.py turns a Snapshot into Prometheus metrics.)

A replica that does not answer /metrics is recorded as down (`up=False`, `error=...`), never raised.
Parsing and aggregation are pure functions over text and dicts (tests run them on saved vLLM output).
Tokens/s come from the change of vLLM's token counters between two scrapes of the same replica.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from hpcserve.core.errors import HpcserveError
from hpcserve.core.keys import bearer
from hpcserve.engine.metrics import (
    GENERATION_TOKENS,
    KV_CACHE_USAGE,
    PROMPT_TOKENS,
    RUNNING,
    WAITING,
    EngineMetric,
    counter_rate,
    parse_engine_metrics,
    peak,
    total,
)

STALE_AFTER_S = 10.0  # the sampler writes every second: a node silent this long has lost its sampler
HISTORY_SAMPLES = 120
MIB = 2**20


# ------------------------------------------------------------------ replicas

@dataclass
class ReplicaMetrics:
    index: int
    url: str
    model: str | None = None
    nodes: list[str] = field(default_factory=list)
    healthy: bool | None = None  # /health, as `hpcserve status` checks it
    up: bool = False  # /metrics answered and parsed
    error: str | None = None
    scraped_at: float = 0.0  # wall clock
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None  # 0..1
    generation_tokens_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    engine: list[EngineMetric] = field(default_factory=list, repr=False)
    monotonic: float = field(default=0.0, repr=False)  # when scraped, for rates

    def to_json(self) -> dict:
        data = asdict(self)
        del data["engine"], data["monotonic"]
        return data


def replica_from_text(replica: dict, text: str, scraped_at: float, monotonic: float) -> ReplicaMetrics:
    """A replica's metrics from its /metrics text (replica: an entry of state.json's `replicas`). Pure."""
    base = _replica_base(replica, scraped_at, monotonic)
    try:
        engine = parse_engine_metrics(text)
    except ValueError as exc:
        base.error = f"/metrics is not Prometheus text: {exc}"
        return base
    base.up, base.engine = True, engine
    base.running, base.waiting = total(engine, RUNNING), total(engine, WAITING)
    base.kv_cache_usage = peak(engine, *KV_CACHE_USAGE)
    base.generation_tokens_total = total(engine, GENERATION_TOKENS)
    base.prompt_tokens_total = total(engine, PROMPT_TOKENS)
    return base


def replica_down(replica: dict, error: str, scraped_at: float, monotonic: float) -> ReplicaMetrics:
    base = _replica_base(replica, scraped_at, monotonic)
    base.error = error
    return base


def _replica_base(replica: dict, scraped_at: float, monotonic: float) -> ReplicaMetrics:
    return ReplicaMetrics(index=int(replica.get("index", 0)), url=replica["url"], model=replica.get("model"),
                          nodes=list(replica.get("nodes") or []), healthy=replica.get("healthy"),
                          scraped_at=scraped_at, monotonic=monotonic)


def with_rates(current: ReplicaMetrics, previous: ReplicaMetrics | None) -> ReplicaMetrics:
    """Set tokens/s from the previous scrape of the same replica. Pure (changes and returns current)."""
    if previous is None or not previous.up or not current.up:
        return current
    current.generation_tokens_per_s = counter_rate(previous.generation_tokens_total, previous.monotonic,
                                                   current.generation_tokens_total, current.monotonic)
    current.prompt_tokens_per_s = counter_rate(previous.prompt_tokens_total, previous.monotonic,
                                               current.prompt_tokens_total, current.monotonic)
    return current


def scrape(client: httpx.Client, replica: dict, api_key: str | None) -> ReplicaMetrics:
    """GET {url}/metrics; any failure gives a replica marked down with the reason."""
    now, mono = time.time(), time.monotonic()
    try:
        response = client.get(f"{replica['url']}/metrics", headers=bearer(api_key))
    except httpx.HTTPError as exc:
        return replica_down(replica, f"{type(exc).__name__}: {exc}"[:300], now, mono)
    if response.status_code != 200:
        return replica_down(replica, f"/metrics answered HTTP {response.status_code}", now, mono)
    return replica_from_text(replica, response.text, now, mono)


# ------------------------------------------------------------------ nodes

@dataclass
class NodeMetrics:
    host: str
    latest: dict | None  # the newest sample, as the sampler wrote it
    age_s: float | None  # seconds since that sample
    stale: bool  # no sample for STALE_AFTER_S: the sampler (or the node) is gone
    history: list[dict] = field(default_factory=list)  # time, cpu_pct, ram_used_mb, engine_rss_mb, gpu_util_pct

    def to_json(self) -> dict:
        return asdict(self)


def last_lines(text: str, count: int) -> list[dict]:
    """The last `count` JSON lines of a sampler file's tail; a cut first line or a half-written last one
    is skipped. Pure."""
    out: list[dict] = []
    for line in reversed(text.splitlines()):
        if len(out) == count:
            break
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out[::-1]


def tail_samples(path: Path, count: int = HISTORY_SAMPLES, max_bytes: int = 256 * 1024) -> list[dict]:
    """The newest samples of one node file, reading only its end (files grow by one line a second)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            return last_lines(handle.read().decode("utf-8", "replace"), count)
    except OSError:
        return []


def history_point(sample: dict) -> dict:
    gpus = sample.get("gpus") or []
    util = sum(g.get("util_pct", 0) for g in gpus) / len(gpus) if gpus else None
    return {"time": sample.get("time"), "cpu_pct": sample.get("cpu_pct"), "ram_used_mb": sample.get("ram_used_mb"),
            "engine_rss_mb": sample.get("engine_rss_mb"), "gpu_util_pct": util}


def node_metrics(host: str, samples: list[dict], now: float, stale_after_s: float = STALE_AFTER_S) -> NodeMetrics:
    """A node's state from its newest samples (oldest first). Pure."""
    if not samples:
        return NodeMetrics(host, None, None, True)
    latest = samples[-1]
    age = max(0.0, now - float(latest.get("time", 0)))
    return NodeMetrics(host, latest, round(age, 1), age > stale_after_s, [history_point(s) for s in samples])


def monitor_files(run_dir: Path) -> list[Path]:
    """The samplers' files of a deployment; an endpoint's members keep theirs in their own run folders."""
    return [*run_dir.glob("monitor/*.jsonl"), *run_dir.glob("members/logs/*/monitor/*.jsonl")]


def read_nodes(run_dir: Path, now: float, count: int = HISTORY_SAMPLES) -> list[NodeMetrics]:
    return [node_metrics(path.stem, tail_samples(path, count), now)
            for path in sorted(monitor_files(Path(run_dir)))]


# ------------------------------------------------------------------ one deployment, now

@dataclass
class Snapshot:
    deployment: dict  # name, status, stage, runner, scheduler, run_dir, error, job_id
    replicas: list[ReplicaMetrics]
    nodes: list[NodeMetrics]
    time: float

    def to_json(self) -> dict:
        return {"deployment": self.deployment, "time": self.time,
                "replicas": [r.to_json() for r in self.replicas], "nodes": [n.to_json() for n in self.nodes]}


class Gatherer:
    """Snapshots of one deployment. Thread-safe; a snapshot younger than max_age_s is reused.

    status_fn(name) gives the deployment's status (api.status's row), key_fn(name) its API key; the CLI
    passes the API's, tests pass stand-ins (and an httpx.MockTransport in the client).
    """

    def __init__(self, name: str, status_fn: Callable, key_fn: Callable[[str], str | None],
                 client: httpx.Client | None = None, max_age_s: float = 1.0, timeout_s: float = 2.0):
        self.name = name
        # trust_env=False: engines are reached directly, never through the user's http_proxy
        self.client = client or httpx.Client(timeout=httpx.Timeout(timeout_s, connect=1.0), trust_env=False)
        self.status_fn = status_fn
        self.key_fn = key_fn
        self.max_age_s = max_age_s
        self.lock = threading.Lock()
        self.last: Snapshot | None = None
        self.last_mono = 0.0
        self.previous: dict[str, ReplicaMetrics] = {}  # url -> last scrape, for rates

    def snapshot(self) -> Snapshot:
        with self.lock:
            if self.last is None or time.monotonic() - self.last_mono >= self.max_age_s:
                self.last, self.last_mono = self._gather(), time.monotonic()
            return self.last

    def _gather(self) -> Snapshot:
        try:
            status = self.status_fn(self.name)
        except HpcserveError as exc:  # `down` removed it, or it never existed: say so, keep serving
            return Snapshot({"name": self.name, "status": "unknown", "stage": None, "runner": str(exc),
                             "scheduler": None, "run_dir": None, "error": None, "job_id": None}, [], [], time.time())
        key = self.key_fn(self.name)
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(status.replicas)))) as pool:
            scraped = list(pool.map(lambda rep: scrape(self.client, rep, key), status.replicas))
        replicas = [with_rates(r, self.previous.get(r.url)) for r in scraped]
        for r in replicas:  # a replica that was down starts its rates afresh
            if r.up:
                self.previous[r.url] = r
            else:
                self.previous.pop(r.url, None)
        deployment = {k: v for k, v in vars(status).items() if k != "replicas"}
        return Snapshot(deployment, replicas, read_nodes(Path(status.run_dir), time.time()), time.time())

    def close(self) -> None:
        self.client.close()
