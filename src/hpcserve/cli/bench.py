"""`hpcserve bench TARGET`: a thin typer layer over `run_benchmark` (mounted by hpcserve.cli.main).

Every user mistake becomes one line on stderr and exit code 2 (an HpcserveError's exit code), no traceback.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from hpcserve import api
from hpcserve.benchmark.bench import BenchOptions, run_benchmark
from hpcserve.benchmark.compare import compare_files
from hpcserve.benchmark.loadgen import LoadShape, RequestOutput
from hpcserve.benchmark.plots import write_plots
from hpcserve.benchmark.report import error_lines, summary_table
from hpcserve.benchmark.summary import BenchResult, parse_slo
from hpcserve.benchmark.workload import LengthRange, parse_length_range
from hpcserve.core.errors import HpcserveError, UsageError


def parse_int_list(option: str, text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]."""
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        raise UsageError(f"{option} '{text}': expected whole numbers separated by commas, e.g. 1,4,16") from None
    if any(value < 1 for value in values):
        raise UsageError(f"{option} '{text}': every value must be at least 1")
    return values


def parse_rate_list(option: str, text: str) -> list[float]:
    """'1,2,inf' -> [1.0, 2.0, inf]."""
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        raise UsageError(f"{option} '{text}': expected numbers or 'inf' separated by commas, e.g. 1,2,inf") from None
    if any(math.isnan(value) or value <= 0 for value in values):
        raise UsageError(f"{option} '{text}': every value must be positive (or inf)")
    return values


def build_loads(concurrency: str | None, request_rate: str | None) -> tuple[LoadShape, ...]:
    """The sweep. One option may list several values; the other, if given, applies to every run."""
    limits: list[int | None] = list(parse_int_list("--concurrency", concurrency)) if concurrency else [None]
    rates = parse_rate_list("--request-rate", request_rate) if request_rate else [math.inf]
    if len(limits) > 1 and len(rates) > 1:
        raise UsageError("sweep one of --concurrency and --request-rate, not both (the other may be one value)")
    return tuple(LoadShape(limit, rate) for limit in limits for rate in rates)


def read_api_key(env_name: str | None) -> str | None:
    if env_name is None:
        return None
    key = os.environ.get(env_name)
    if not key:
        raise UsageError(f"--api-key-env {env_name}: that environment variable is not set")
    return key


class RichProgress:
    """The progress bar of the current load point (implements runner.Progress)."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.task: TaskID | None = None

    def start_run(self, label: str, total: int) -> None:
        self.task = self.progress.add_task(label, total=total)

    def request_done(self, output: RequestOutput) -> None:
        if self.task is not None:  # None only before the first start_run
            self.progress.advance(self.task)


def _progress_bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)


def _show(result: BenchResult, console: Console) -> None:

    console.print(summary_table(result))
    for line in error_lines(result):
        console.print(f"[yellow]error:[/] {line}", markup=True, highlight=False)


def _compare(files: list[str], console: Console) -> None:
    if len(files) < 2:
        raise UsageError("--compare needs at least two results files: hpcserve bench --compare A.json B.json")
    for table in compare_files(files):
        console.print(table)


def _options(num_prompts, concurrency, request_rate, input_len, input_len_range, output_len, dataset, model, slo,
             seed, timeout, gpus) -> BenchOptions:
    lengths = parse_length_range(input_len_range) if input_len_range else LengthRange(input_len, input_len)
    if lengths.low < 1:
        raise UsageError("--input-len must be at least 1")
    if dataset and input_len_range:
        raise UsageError("--dataset brings its own prompts: drop --input-len-range")
    return BenchOptions(loads=build_loads(concurrency, request_rate), num_prompts=num_prompts, input_len=lengths,
                        output_len=output_len, dataset=str(dataset) if dataset else None, model=model,
                        slo=parse_slo(slo), seed=seed, timeout_s=timeout, gpus=gpus)


def bench(
    targets: Annotated[list[str] | None, typer.Argument(
        metavar="TARGET", help="Deployment name or URL (http://host:port). With --compare: results files.")] = None,
    num_prompts: Annotated[int | None, typer.Option(
        help="Requests per load point [default: 100, or the whole --dataset].")] = None,
    concurrency: Annotated[str | None, typer.Option(
        help="Requests in flight at most; a list sweeps, e.g. 1,4,16.")] = None,
    request_rate: Annotated[str | None, typer.Option(
        help="Poisson arrivals per second; a list sweeps, e.g. 1,2,inf [default: inf].")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt length in tokens (random token ids).")] = 128,
    input_len_range: Annotated[str | None, typer.Option(
        help="Prompt lengths drawn uniformly from MIN:MAX instead of --input-len.")] = None,
    output_len: Annotated[int, typer.Option(help="Tokens generated per request (exact: ignore_eos).")] = 128,
    dataset: Annotated[Path | None, typer.Option(
        help='JSONL prompts: {"prompt": text or token ids, "output_len": n} per line.')] = None,
    model: Annotated[str | None, typer.Option(help="Model name [default: the deployment's, or the server's].")] = None,
    api_key_env: Annotated[str | None, typer.Option(
        help="Environment variable holding the API key [default: a deployment's own key].")] = None,
    slo: Annotated[str | None, typer.Option(help="Goodput SLO, e.g. ttft_ms=500,tpot_ms=50 (also e2e_ms).")] = None,
    seed: Annotated[int, typer.Option(help="Seed for prompts and arrival times.")] = 0,
    out: Annotated[Path | None, typer.Option(help="Write the results (all load points) to this JSON file.")] = None,
    plots: Annotated[Path | None, typer.Option(help="Write PNG plots into this folder.")] = None,
    compare: Annotated[bool, typer.Option(
        "--compare", help="Compare results files given as arguments: hpcserve bench --compare A.json B.json")] = False,
    timeout: Annotated[float, typer.Option(help="Deadline of each load point, seconds.")] = 600.0,
    gpus: Annotated[int | None, typer.Option(help="GPUs behind TARGET, recorded for --compare's efficiency.")] = None,
) -> None:
    """Measure an OpenAI-compatible endpoint: throughput, TTFT/TPOT/ITL/E2E percentiles, goodput."""
    console, errors = Console(), Console(stderr=True)
    try:
        if compare:
            return _compare(targets or [], console)
        if not targets or (len(targets) > 1 and not all(t.startswith(("http://", "https://")) for t in targets)):
            raise UsageError("give one TARGET (a deployment name or URL), several URLs (requests go round-robin), "
                             "or --compare FILES")
        options = _options(num_prompts, concurrency, request_rate, input_len, input_len_range, output_len, dataset,
                           model, slo, seed, timeout, gpus)
        _check_out_folder(out)
        key = read_api_key(api_key_env)
        endpoints = [endpoint for target in targets for endpoint in api.endpoints(target, key)]
        with _progress_bar(errors) as bar:
            result = run_benchmark(endpoints, options, target=" ".join(targets), command=sys.argv,
                                   progress=RichProgress(bar))
        _show(result, console)
        _save(result, out, plots, console)
    except HpcserveError as exc:
        errors.print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        errors.print("[red]interrupted[/]")
        raise typer.Exit(130) from None


def _check_out_folder(out: Path | None) -> None:
    """Before the run, not after: a long benchmark must not end in 'no such directory'."""
    if out and not out.resolve().parent.is_dir():
        raise UsageError(f"--out {out}: the folder {out.resolve().parent} does not exist")


def _save(result: BenchResult, out: Path | None, plots: Path | None, console: Console) -> None:
    if out:
        result.save(out)
        console.print(f"results: {out}")
    if plots:

        for path in write_plots(result, plots):
            console.print(f"plot: {path}")
