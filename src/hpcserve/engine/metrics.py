"""vLLM's Prometheus /metrics: parsed (pure), and an engine's load read from them.

Parsing keeps gauges and counters (histograms are left to vLLM's own /metrics); the load is what the
endpoint's controller decides with: requests running and waiting, KV-cache usage, requests finished.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

VLLM_PREFIX = "vllm:"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
FINISHED = "vllm:request_success"  # requests finished (a counter, by finish reason)
GENERATION_TOKENS = "vllm:generation_tokens"  # counter family names are given without "_total"
PROMPT_TOKENS = "vllm:prompt_tokens"
KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, old name
CACHE_CONFIG = "vllm:cache_config_info"  # the engine's CacheConfig as labels (num_gpu_blocks, block_size)


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
    """An engine's load from vLLM's Prometheus text: the same figures as parse_engine_metrics gives, read
    from the few sample lines they come from. A controller reads every replica's /metrics five times a
    second, and the whole page (50 KB, mostly histograms) took prometheus_client's parser 20-75 ms here:
    at 256 replicas that alone is more than the machine has (benchmarks/results/scale.md). Raises
    ValueError when one of those lines carries no number."""
    samples = sample_values(metrics_text, (RUNNING, WAITING, *KV_CACHE_USAGE, FINISHED + "_total"))
    kv = next((max(samples[n]) for n in KV_CACHE_USAGE if samples[n]), None)
    finished = samples[FINISHED + "_total"]
    return EngineLoad(float(sum(samples[RUNNING])), float(sum(samples[WAITING])), kv,
                      float(sum(finished)) if finished else None)


def sample_values(text: str, names: tuple[str, ...]) -> dict[str, list[float]]:
    """The values of every sample line named exactly one of `names` (any labels), by name. Comment
    lines and other families are skipped without being parsed. Pure."""
    found: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        start = 0
        while (at := text.find(name, start)) >= 0:
            start = at + len(name)
            if (at and text[at - 1] != "\n") or text[start:start + 1] not in ("{", " "):
                continue  # inside a comment, or a longer name (vllm:num_requests_waiting_by_reason)
            end = text.find("\n", start)
            line = text[at:end if end >= 0 else len(text)]
            found[name].append(sample_value(line))
    return found


def sample_value(line: str) -> float:
    """The value of one sample line: `name{labels} value [timestamp]`; label values may hold spaces."""
    rest = line[line.rfind("}") + 1:] if "{" in line else line.split(" ", 1)[1] if " " in line else ""
    words = rest.split()
    if not words:
        raise ValueError(f"a sample without a value: {line[:120]!r}")
    try:
        return float(words[0])
    except ValueError:
        raise ValueError(f"not a number in {line[:120]!r}") from None


def kv_cache_tokens(metrics_text: str) -> int | None:
    """The tokens an engine's KV cache holds (num_gpu_blocks x block_size of vllm:cache_config_info; the
    smallest where several engines answer); None when its /metrics do not say. Pure."""
    sizes = []
    for metric in parse_engine_metrics(metrics_text):
        for labels, _ in metric.samples if metric.name == CACHE_CONFIG else ():
            config = dict(labels)
            try:
                sizes.append(int(config["num_gpu_blocks"]) * int(config["block_size"]))
            except (KeyError, ValueError):  # "None" before the engine sized its cache
                continue
    return min(sizes) if sizes and min(sizes) > 0 else None


def is_drained(load: EngineLoad) -> bool:
    """Nothing running, nothing queued: the engine can be stopped without failing a request."""
    return load.in_flight == 0


def is_saturated(load: EngineLoad, max_waiting: float = 0.0, max_kv_usage: float = 0.95, slots: int = 0) -> bool:
    """Requests queue in the engine with its slots taken (running >= slots, its --max-num-seqs when known),
    or its KV cache is nearly full: more requests there only wait. A request also waits one scheduler
    step in an engine with free slots: that is not saturation. For the control plane; the data plane
    balances in-flight counts itself."""
    kv_full = load.kv_cache_usage is not None and load.kv_cache_usage >= max_kv_usage
    return kv_full or (load.waiting > max_waiting and load.running >= slots)
