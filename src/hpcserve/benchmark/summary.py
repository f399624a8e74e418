"""Pure functions from request outputs to the numbers people compare: latencies, throughput, goodput.

Definitions follow vLLM's `vllm bench serve` so results line up with it:
- TPOT of a request = (E2E - TTFT) / (output_tokens - 1), for requests with more than one token;
  for goodput a one-token request counts as TPOT 0.
- ITL percentiles are over all inter-chunk gaps of all successful requests.
- Throughputs divide by the run's wall time (first dispatch to last completion).
- Percentiles: hpcserve.benchmark.stats.percentile (linear interpolation, numpy's default).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpcserve.benchmark.loadgen import LoadShape, RequestOutput
from hpcserve.benchmark.stats import percentile
from hpcserve.core.errors import UsageError

SLO_KEYS = {"ttft_ms": "time to first token", "tpot_ms": "time per output token", "e2e_ms": "end-to-end latency"}
MAX_ERRORS_KEPT = 5
FORMAT_VERSION = 1


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds. None when there was nothing to measure (e.g. every request failed)."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, values: list[float]) -> LatencyStats:
        ms = [1000.0 * v for v in values]
        mean = sum(ms) / len(ms) if ms else None
        return cls(mean, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass(frozen=True)
class RunSummary:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # successful requests per second
    input_throughput: float  # prompt tokens per second
    output_throughput: float  # generated tokens per second
    total_input_tokens: int
    total_output_tokens: int
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    goodput: float | None  # requests per second meeting every SLO; None without an SLO
    first_errors: list[str] = field(default_factory=list)


def tpot_s(output: RequestOutput) -> float | None:
    if not output.ok or output.output_tokens <= 1 or output.ttft_s is None or output.e2e_s is None:
        return None
    return (output.e2e_s - output.ttft_s) / (output.output_tokens - 1)


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft_ms=500,tpot_ms=50' -> {'ttft_ms': 500.0, 'tpot_ms': 50.0}."""
    if not text:
        return {}
    slo = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise UsageError(f"--slo '{item}': expected KEY=MILLISECONDS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise UsageError(f"--slo '{item}': '{value}' is not a number of milliseconds") from None
        if slo[key] <= 0:
            raise UsageError(f"--slo '{item}': the limit must be positive")
    return slo


def meets_slo(output: RequestOutput, slo: dict[str, float]) -> bool:
    if not output.ok or output.ttft_s is None or output.e2e_s is None:
        return False
    measured_ms = {"ttft_ms": 1000.0 * output.ttft_s, "tpot_ms": 1000.0 * (tpot_s(output) or 0.0),
                   "e2e_ms": 1000.0 * output.e2e_s}
    return all(measured_ms[key] <= limit for key, limit in slo.items())


def first_errors(outputs: list[RequestOutput], limit: int = MAX_ERRORS_KEPT) -> list[str]:
    """The first distinct error messages, in order of appearance."""
    seen: list[str] = []
    for output in outputs:
        if not output.ok and output.error is not None and output.error not in seen:
            seen.append(output.error)
            if len(seen) == limit:
                break
    return seen


def summarize(outputs: list[RequestOutput], duration_s: float, slo: dict[str, float] | None = None) -> RunSummary:
    good = [o for o in outputs if o.ok]
    per_second = (lambda count: count / duration_s) if duration_s > 0 else (lambda count: 0.0)
    input_tokens = sum(o.prompt_tokens or 0 for o in good)
    output_tokens = sum(o.output_tokens for o in good)
    return RunSummary(
        completed=len(good), failed=len(outputs) - len(good), duration_s=duration_s,
        request_throughput=per_second(len(good)), input_throughput=per_second(input_tokens),
        output_throughput=per_second(output_tokens), total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        ttft_ms=LatencyStats.of_seconds([o.ttft_s for o in good if o.ttft_s is not None]),
        tpot_ms=LatencyStats.of_seconds([t for o in good if (t := tpot_s(o)) is not None]),
        itl_ms=LatencyStats.of_seconds([gap for o in good for gap in o.itl_s]),
        e2e_ms=LatencyStats.of_seconds([o.e2e_s for o in good if o.e2e_s is not None]),
        goodput=per_second(sum(meets_slo(o, slo) for o in good)) if slo else None,
        first_errors=first_errors(outputs),
    )


@dataclass(frozen=True)
class RequestRecord:
    """One request as stored in the results file (ITL gaps left out: they would dominate the file)."""

    ok: bool
    start_s: float
    ttft_s: float | None
    e2e_s: float | None
    prompt_tokens: int | None
    output_tokens: int
    error: str | None

    @classmethod
    def of(cls, output: RequestOutput) -> RequestRecord:
        return cls(output.ok, output.start_s, output.ttft_s, output.e2e_s, output.prompt_tokens,
                   output.output_tokens, output.error)


@dataclass(frozen=True)
class BenchRun:
    """One load point of a sweep: its configuration, summary and per-request records."""

    load: dict[str, Any]  # {"concurrency": int | None, "request_rate": float | "inf"}
    summary: RunSummary
    requests: list[RequestRecord] = field(default_factory=list)
    started_at: float | None = None  # epoch seconds at the run's start; requests' start_s count from it

    @property
    def label(self) -> str:
        return LoadShape.from_dict(self.load).label


@dataclass(frozen=True)
class BenchResult:
    """A whole `hpcserve bench` invocation: what was run against what, and every load point."""

    target: str
    date: str  # ISO 8601, UTC
    command: list[str]
    config: dict[str, Any]
    endpoints: list[str]
    runs: list[BenchRun]
    gpus: int | None = None  # GPUs behind the target, when known: compare divides by it
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=_json_default)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


def _json_default(value: Any) -> Any:
    return str(value)


def result_from_dict(data: dict[str, Any]) -> BenchResult:
    runs = [BenchRun(load=run["load"], summary=_summary_from_dict(run["summary"]),
                     requests=[RequestRecord(**r) for r in run.get("requests", [])],
                     started_at=run.get("started_at")) for run in data["runs"]]
    return BenchResult(target=data["target"], date=data["date"], command=data["command"], config=data["config"],
                       endpoints=data["endpoints"], runs=runs, gpus=data.get("gpus"),
                       format_version=data.get("format_version", FORMAT_VERSION))


def _summary_from_dict(data: dict[str, Any]) -> RunSummary:
    stats = {k: LatencyStats(**data[k]) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")}
    return RunSummary(**{**data, **stats})


def load_result(path: str | Path) -> BenchResult:
    """Read a results file written by `hpcserve bench --out`; a clear UsageError if it is not one."""
    path = Path(path)
    try:
        return result_from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UsageError(f"{path}: not an `hpcserve bench` results file ({type(exc).__name__}: {exc})") from None
