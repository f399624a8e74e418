"""What a person reads after a run: one column per load point, one row per metric, then the first errors."""

from __future__ import annotations

from collections.abc import Callable

from rich.table import Table

from hpcserve.benchmark.summary import BenchResult, LatencyStats, RunSummary


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _p50_p99(stats: LatencyStats) -> str:
    return f"{_ms(stats.p50)} / {_ms(stats.p99)}"


# Shared with `--compare`, so both tables read the same way.
METRIC_ROWS: list[tuple[str, Callable[[RunSummary], str]]] = [
    ("ok / failed", lambda s: f"{s.completed} / {s.failed}"),
    ("requests/s", lambda s: f"{s.request_throughput:.2f}"),
    ("output tok/s", lambda s: f"{s.output_throughput:.1f}"),
    ("input tok/s", lambda s: f"{s.input_throughput:.1f}"),
    ("TTFT p50 / p99 (ms)", lambda s: _p50_p99(s.ttft_ms)),
    ("TPOT p50 / p99 (ms)", lambda s: _p50_p99(s.tpot_ms)),
    ("ITL p50 / p99 (ms)", lambda s: _p50_p99(s.itl_ms)),
    ("E2E p50 / p99 (ms)", lambda s: _p50_p99(s.e2e_ms)),
    ("goodput (req/s)", lambda s: "-" if s.goodput is None else f"{s.goodput:.2f}"),
]


def summary_table(result: BenchResult) -> Table:
    table = Table(title=f"{result.target}: {len(result.endpoints)} endpoint(s), {result.date}", title_justify="left")
    table.add_column("metric")
    for run in result.runs:
        table.add_column(run.label, justify="right")
    for name, render in METRIC_ROWS:
        table.add_row(name, *(render(run.summary) for run in result.runs))
    return table


def error_lines(result: BenchResult) -> list[str]:
    """The first distinct errors of each run that had failures."""
    return [f"[{run.label}] {error}" for run in result.runs for error in run.summary.first_errors]
