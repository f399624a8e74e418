"""The commands over a deployment file that leave nothing running: `render`, `check`, `plan`, `validate`,
`baseline` (mounted by hpcserve.cli.main)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from hpcserve import api
from hpcserve.benchmark.bench import BenchOptions
from hpcserve.benchmark.loadgen import LoadShape
from hpcserve.benchmark.workload import LengthRange
from hpcserve.cli.common import ConfigArg, SiteOption, console, err, guarded
from hpcserve.core.config import Layout, load_config
from hpcserve.core.errors import UsageError
from hpcserve.core.paths import RunPaths
from hpcserve.core.runstate import RunState
from hpcserve.deployment.runs import config_yaml
from hpcserve.planning.catalog import listing
from hpcserve.planning.model_source import model_config_for, resolve_model_path
from hpcserve.planning.planner import check_config_layout, plan_for_config
from hpcserve.planning.report import explain, render_plan_table
from hpcserve.raycluster.health import HealthReport, render_lines, render_table
from hpcserve.site.files import load_with_site
from hpcserve.slurm.render import render_batch_script
from hpcserve.workflows.baseline import baseline as run_baseline
from hpcserve.workflows.validate import report_lines, write_report
from hpcserve.workflows.validate import validate as run_validation


@guarded
def render(config: Path = ConfigArg, site: Path | None = SiteOption):
    """Print the sbatch script `up` would submit (dry run; nothing is submitted)."""
    cfg = load_with_site(config, site)
    print(render_batch_script(cfg, config_yaml(cfg), sys.executable, Path(cfg.results_dir).resolve()), end="")


@guarded
def check(config: Path = ConfigArg):
    """Run the distributed health check on the config's nodes, alone: per-node GPUs/CPUs/RAM, object
    transfer between every pair of nodes, an all-reduce (NCCL on GPUs, gloo on CPUs), scheduling latency.

    `up` runs the same check as one of its stages.
    """
    run_dir, data = api.check(config, on_event=lambda e: console.print(f"· {e.stage} {e.event} {e.detail}", highlight=False))
    if not data:
        failure = RunState.read(run_dir).error
        error = failure.to_dict() if failure else {}
        err.print(f"[red]check failed[/] at stage '{error.get('stage', '?')}': {error.get('diagnosis', '?')}")
        err.print(f"read: {error.get('log') or run_dir}")
        raise typer.Exit(1)
    report = HealthReport.from_dict(data)
    console.print(render_table(report))
    for line in render_lines(report):
        console.print(line, highlight=False)
    console.print(f"report: {RunPaths(run_dir).health}")
    if not report.ok:
        raise typer.Exit(1)


@guarded
def plan(config: Path | None = typer.Argument(None, help="deployment YAML (see examples/local.yaml)", show_default=False),
         concurrency: int | None = typer.Option(None, min=1, help="requests in flight to plan for (default: "
                                                "serve.expected_concurrency; neither: rank by capacity)"),
         list_models: bool = typer.Option(False, "--list-models", help="list the model catalogue (model.catalog names)")):
    """Pick the tensor x pipeline x replicas layout that fits the model and serves the most tokens/s.

    Reads the model's config.json (or the catalogue shape named by model.catalog) and the cluster section;
    explains weights per GPU, KV-cache capacity, the concurrent sequences that fit at max_model_len and, with
    an expected concurrency, how loaded each replica is. `parallelism: auto` uses the same choice.
    """
    if list_models:

        for line in listing():
            console.print(line, highlight=False)
        return
    if config is None:
        raise UsageError("give a deployment YAML (hpcserve plan CONFIG), or --list-models for the model catalogue")
    cfg = load_config(config)
    if concurrency is not None:
        cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"expected_concurrency": concurrency})})
    model_config = model_config_for(cfg, resolve_model_path(cfg))
    result = plan_for_config(cfg, model_config)
    console.print(render_plan_table(result))
    for line in explain(result):
        console.print(line, highlight=False)
    if isinstance(cfg.parallelism, Layout):
        problems = check_config_layout(cfg, model_config, cfg.parallelism)
        ours = f"{cfg.parallelism.tensor}x{cfg.parallelism.pipeline}x{cfg.parallelism.replicas}"
        console.print(f"configured layout {ours}: " + ("; ".join(problems) if problems else "fits"), highlight=False)


@guarded
def validate(config: Path = ConfigArg,
             concurrency: int = typer.Option(8, min=1, help="the N of the second load point (the first is 1)"),
             num_prompts: int = typer.Option(32, min=1, help="requests per load point"),
             input_len: int = typer.Option(64, min=1, help="prompt tokens per request"),
             output_len: int = typer.Option(32, min=1, help="generated tokens per request")):
    """Validate the model on ONE node: load it, sample memory while loading and serving, measure TTFT,
    TPOT, requests/s and tokens/s at concurrency 1 and N, stop it again.

    Writes validation.json and validation.md into RESULTS/logs/NAME/.
    """
    cfg = load_config(config)
    result = run_validation(config, concurrency, num_prompts, input_len, output_len,
                            on_event=lambda e: console.print(f"· {e.stage} {e.event} {e.detail}", highlight=False))
    folder = write_report(result, Path(cfg.results_dir).resolve(), cfg.name)
    console.print("\n".join(report_lines(result)), highlight=False)
    console.print(f"written: {folder / 'validation.json'}, {folder / 'validation.md'}")
    if not result.ok:
        raise typer.Exit(1)


@guarded
def baseline(config: Path = ConfigArg,
             concurrency: str = typer.Option("1,8", help="load points, e.g. 1,8,32"),
             num_prompts: int = typer.Option(64, min=1, help="requests per load point"),
             input_len: int = typer.Option(128, min=1, help="prompt tokens per request"),
             output_len: int = typer.Option(64, min=1, help="generated tokens per request")):
    """Benchmark a single-node layout and the configured multi-node layout with the same load, one after
    the other, and report the scaling efficiency (markdown + plots in RESULTS/logs/NAME/baseline/)."""
    try:
        loads = tuple(LoadShape(concurrency=int(c)) for c in concurrency.split(","))
    except ValueError:
        raise UsageError(f"--concurrency {concurrency!r}: give whole numbers separated by commas, e.g. 1,8") from None
    options = BenchOptions(loads=loads, num_prompts=num_prompts, input_len=LengthRange(input_len, input_len),
                           output_len=output_len)
    folder = run_baseline(config, options,
                          on_event=lambda e: console.print(f"· {e.stage} {e.event} {e.detail}", highlight=False))
    console.print((folder / "baseline.md").read_text(), highlight=False)
    console.print(f"written: {folder}")
