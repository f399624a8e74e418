"""vLLM's Prometheus /metrics: parsed (pure), and an engine's load read from them.

Parsing keeps gauges and counters (histograms are left to vLLM's own /metrics); the load is what the
endpoint's controller decides with: requests running and waiting, KV-cache usage, requests finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from prometheus_client.parser import text_string_to_metric_families

VLLM_PREFIX = "vllm:"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
FINISHED = "vllm:request_success"  # requests finished (a counter, by finish reason)
GENERATION_TOKENS = "vllm:generation_tokens"  # counter family names are given without "_total"
PROMPT_TOKENS = "vllm:prompt_tokens"
KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, old name


# ------------------------------------------------------------------ parsing (pure)

@dataclass(frozen=True)
class EngineMetric:
    """One vLLM gauge or counter family: its samples as (labels, value)."""

    name: str  # family name; a counter's samples are named name + "_total"
    kind: str  # "gauge" or "counter"
    doc: str
    samples: tuple[tuple[tuple[tuple[str, str], ...], float], ...]


def parse_engine_metrics(text: str) -> list[EngineMetric]:
    """vLLM's gauges and counters from Prometheus text. Left out: histograms (read vLLM's own /metrics for
    latency distributions) and the `*_created` timestamps of counters. Raises ValueError on text that is not
    the Prometheus format."""
    out = []
    for family in text_string_to_metric_families(text):
        if (not family.name.startswith(VLLM_PREFIX) or family.type not in ("gauge", "counter")
                or family.name.endswith("_created")):
            continue
        sample_name = family.name + ("_total" if family.type == "counter" else "")
        samples = tuple((tuple(sorted(s.labels.items())), s.value) for s in family.samples if s.name == sample_name)
        out.append(EngineMetric(family.name, family.type, family.documentation, samples))
    return out


def total(metrics: Iterable[EngineMetric], *names: str) -> float | None:
    """The sum over label sets of the first family present among names; None when none is."""
    by_name = {m.name: m for m in metrics}
    for name in names:
        if name in by_name:
            return sum(value for _, value in by_name[name].samples)
    return None


def peak(metrics: Iterable[EngineMetric], *names: str) -> float | None:
    """The largest value of the first family present (KV-cache usage of several engines: the fullest)."""
    by_name = {m.name: m for m in metrics}
    for name in names:
        if name in by_name and by_name[name].samples:
            return max(value for _, value in by_name[name].samples)
    return None


def counter_rate(before: float | None, before_t: float | None, after: float | None, after_t: float) -> float | None:
    """Per-second increase of a counter between two readings; None without two readings or after a reset."""
    if before is None or after is None or before_t is None or after_t <= before_t or after < before:
        return None
    return (after - before) / (after_t - before_t)


# ------------------------------------------------------------------ one engine's load (pure)

@dataclass(frozen=True)
class EngineLoad:
    """One engine's load from its vLLM /metrics (summed over its label sets)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float | None = None  # 0..1, the fullest KV cache of the engine
    finished: float | None = None  # requests finished since the engine started (a counter)

    @property
    def in_flight(self) -> float:
        return self.running + self.waiting


def engine_load(metrics_text: str) -> EngineLoad:
    """Parse vLLM's Prometheus text. Raises ValueError on text that is not Prometheus format."""
    metrics = parse_engine_metrics(metrics_text)
    return EngineLoad(total(metrics, RUNNING) or 0.0, total(metrics, WAITING) or 0.0, peak(metrics, *KV_CACHE_USAGE),
                      total(metrics, FINISHED))


def is_drained(load: EngineLoad) -> bool:
    """Nothing running, nothing queued: the engine can be stopped without failing a request."""
    return load.in_flight == 0


def is_saturated(load: EngineLoad, max_waiting: float = 0.0, max_kv_usage: float = 0.95) -> bool:
    """Requests queue in the engine, or its KV cache is nearly full: more requests there only wait.
    For the control plane (scale-up decisions, capacity estimates); the data plane balances in-flight
    counts itself."""
    return load.waiting > max_waiting or (load.kv_cache_usage is not None and load.kv_cache_usage >= max_kv_usage)
