"""`hpcserve bench --compare A.json B.json ...`: results side by side, with scaling efficiency vs the first.

Runs are matched by load point (same concurrency / request rate). Scaling efficiency of B relative
to A = (B's output tokens/s / A's) / (B's GPUs / A's GPUs) when both files record a GPU count,
else the plain throughput ratio (then it reads "speed-up", not efficiency: the table says which).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import RenderableType

from hpcserve.benchmark.report import METRIC_ROWS
from hpcserve.benchmark.summary import BenchResult, BenchRun, load_result
from hpcserve.core.tables import narrow_table, with_lines


@dataclass(frozen=True)
class Column:
    """One results file's run at one load point."""

    name: str
    gpus: int | None
    run: BenchRun


def scaling_efficiency(base: Column, other: Column) -> float | None:
    base_throughput = base.run.summary.output_throughput
    if base_throughput <= 0:
        return None
    ratio = other.run.summary.output_throughput / base_throughput
    if base.gpus and other.gpus:
        return ratio / (other.gpus / base.gpus)
    return ratio


def columns_by_load(named_results: list[tuple[str, BenchResult]]) -> dict[str, list[Column]]:
    """For each load point of the first result, the runs of every file that has that load point."""
    groups: dict[str, list[Column]] = {}
    for run in named_results[0][1].runs:
        groups[run.label] = []
    for name, result in named_results:
        for run in result.runs:
            if run.label in groups:
                groups[run.label].append(Column(name, result.gpus, run))
    return groups


def comparison_table(label: str, columns: list[Column]) -> RenderableType:
    """One column per result file, named [1], [2], ... with the files' paths (whole) below the table."""
    per_gpu = all(column.gpus for column in columns)
    table = narrow_table(f"load: {label}", "metric", *(f"[{i}]" for i in range(1, len(columns) + 1)),
                         left=("metric",))
    for row_name, render in METRIC_ROWS:
        table.add_row(row_name, *(render(column.run.summary) for column in columns))
    table.add_row("GPUs", *(str(column.gpus or "?") for column in columns))
    efficiency_name = "scaling efficiency" if per_gpu else "throughput vs first"
    table.add_row(efficiency_name, *(_percent(scaling_efficiency(columns[0], column)) for column in columns))
    return with_lines(table, [f"[{i}] {column.name}" for i, column in enumerate(columns, start=1)])


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.0f}%"


def compare_files(paths: Sequence[str | Path]) -> list[RenderableType]:
    """One table per load point of the first file; the files that lack that load point are left out."""
    named = [(str(path), load_result(path)) for path in paths]
    return [comparison_table(label, columns) for label, columns in columns_by_load(named).items()]
