"""What a person reads after a run: one column per load point, one row per metric, then the first errors."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import RenderableType

from hpcserve.benchmark.loadgen import LoadShape
from hpcserve.benchmark.summary import BenchResult, RunSummary
from hpcserve.core.tables import narrow_table, with_lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


# Shared with `--compare`, so both tables read the same way.
METRIC_ROWS: list[tuple[str, Callable[[RunSummary], str]]] = [
    ("ok / failed", lambda s: f"{s.completed} / {s.failed}"),
    ("requests/s", lambda s: f"{s.request_throughput:.2f}"),
    ("output tok/s", lambda s: f"{s.output_throughput:.1f}"),
    ("input tok/s", lambda s: f"{s.input_throughput:.1f}"),
    *((f"{name} {pct} ms", lambda s, attr=attr, pct=pct: _ms(getattr(getattr(s, attr), pct)))
      for name, attr in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
      for pct in ("p50", "p99")),
    ("goodput (req/s)", lambda s: "-" if s.goodput is None else f"{s.goodput:.2f}"),
]


def summary_table(result: BenchResult) -> RenderableType:
    """One column per load point; reads at 80 columns for up to four load points."""
    table = narrow_table(f"{len(result.endpoints)} endpoint(s), {result.date}", "metric",
                         *(LoadShape.from_dict(run.load).short_label for run in result.runs), left=("metric",))
    for name, render in METRIC_ROWS:
        table.add_row(name, *(render(run.summary) for run in result.runs))
    return with_lines(table, [f"target: {result.target}"])


def error_lines(result: BenchResult) -> list[str]:
    """The first distinct errors of each run that had failures."""
    return [f"[{run.label}] {error}" for run in result.runs for error in run.summary.first_errors]

