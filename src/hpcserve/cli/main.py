"""The `hpcserve` command: a thin layer over hpcserve.api. User errors exit with code 2 and one message."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console, Group
from rich.text import Text

from hpcserve import api
from hpcserve.benchmark.bench import BenchOptions
from hpcserve.benchmark.loadgen import LoadShape
from hpcserve.benchmark.workload import LengthRange
from hpcserve.cli.bench import bench
from hpcserve.cli.doctor import doctor
from hpcserve.cli.monitor import monitor
from hpcserve.cli.sandbox import app as sandbox_app
from hpcserve.cli.watch import watch as live
from hpcserve.core.config import Layout, load_config
from hpcserve.core.errors import HpcserveError, UsageError
from hpcserve.core.paths import RunPaths
from hpcserve.core.runstate import RunState
from hpcserve.core.statuses import RunStatus, Stage, StageEvent
from hpcserve.core.tables import narrow_table
from hpcserve.core.timeline import breakdown_line
from hpcserve.deployment.runs import config_yaml
from hpcserve.endpoint.holding import describe as describe_holding
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

app = typer.Typer(
    help="Serve LLMs on HPC clusters: Slurm allocates, Ray connects the nodes, vLLM serves; each layer is "
         "checked before the next starts.\n\nStart here: `hpcserve up examples/local.yaml` (this machine, tiny model).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
console = Console(soft_wrap=True)  # paths and URLs stay whole when piped into logs
err = Console(stderr=True, soft_wrap=True)

ConfigArg = typer.Argument(..., help="deployment YAML (see examples/local.yaml)", show_default=False)
NameArg = typer.Argument(..., help="deployment name (the 'name' in its config)", show_default=False)
SiteOption = typer.Option(None, "--site", help="YAML file with the site section (runtime, image, container_command, "
                          "binds, gres); replaces the config's site:", show_default=False)


def fail(exc: HpcserveError) -> None:
    err.print(f"[bold red]error:[/] {exc}", highlight=False, markup=True, soft_wrap=True)
    raise typer.Exit(exc.exit_code)


def guarded(func):
    """Turn hpcserve's errors into one clear message and an exit code, never a traceback."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except HpcserveError as exc:
            fail(exc)
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130)

    return wrapper


# ------------------------------------------------------------------ up / down

STAGE_WAIT = {Stage.ADOPT: "checking the router and every member's job and replicas",
              Stage.RAY: "starting Ray on every node", Stage.HEALTH: "running the health check",
              Stage.ENGINE: "loading the model and waiting for a real completion", Stage.READY: "serving"}


@app.command()
@guarded
def up(config: Path = ConfigArg,
       timeout: Optional[float] = typer.Option(None, help="seconds to wait for ready (default: engine.startup_timeout_s + 600)"),
       site: Optional[Path] = SiteOption):
    """Start a deployment and wait until it serves: job -> Ray cluster -> health check -> engine -> a real completion.

    Returns while the deployment keeps running; stop it with `hpcserve down NAME`.
    """
    spinner = console.status("submitting", spinner="dots")
    with spinner:
        result = api.up(load_with_site(config, site) if site else config, on_event=stage_printer(spinner),
                        timeout_s=timeout)
    if result.adopted is not None:
        adopted_report(result)
        return
    if result.status is not RunStatus.READY:
        error = result.error or {}
        if error:
            err.print(f"[bold red]failed[/] at stage '{error['stage']}': {error['diagnosis']}", highlight=False)
        else:
            err.print(f"[bold red]failed[/] before the driver reported a stage: {result.reason}", highlight=False)
        if error.get("log"):
            err.print(f"read: {error['log']}")
        err.print(f"results folder: {result.run_dir}  (nothing was left running)")
        raise typer.Exit(1)
    console.print(f"[bold green]ready[/] in {result.seconds:.1f} s: {result.name}")
    if result.stages:
        console.print(f"  where the time went: {breakdown_line(result.stages)}", highlight=False)
    if result.endpoint:
        console.print(f"  endpoint: OpenAI base URL [bold]{result.endpoint}/v1[/]  model '{cfg_model(result)}'  "
                      f"({len(result.replicas)} replica(s) behind the router)")
    for rep in result.replicas:
        url = f"{rep['url']}/v1" if result.endpoint else f"[bold]{rep['url']}/v1[/]"
        console.print(f"  replica {rep['index']}: OpenAI base URL {url}  model '{rep['model']}'  "
                      f"nodes {', '.join(rep['nodes'])}")
    if result.api_key_source and result.api_key_source != "none":
        console.print(f"  API key: {result.api_key_source}  (send it as 'Authorization: Bearer KEY')")
    else:
        err.print("[bold red]WARNING: no API key[/] (serve.insecure_no_api_key): every user who reaches "
                  "this machine's ports uses these engines", highlight=False)
    console.print(f"  results folder: {result.run_dir}")
    if result.answer is not None:
        console.print(f"  answer to 'Hello, my name is': [bold]{result.answer!r}[/]")
    console.print(f"  stop with: hpcserve down {result.name}")


def stage_printer(spinner):
    """Each stage event as one line, and the spinner saying what is being waited for."""
    t0 = time.monotonic()

    def show(event: api.Event) -> None:
        mark = {StageEvent.STARTED: "[cyan]…[/]", StageEvent.DONE: "[green]✓[/]",
                StageEvent.FAILED: "[red]✗[/]"}.get(event.event, "·")
        detail = f" [dim]{event.detail}[/]" if event.detail else ""
        console.print(f"{mark} {event.stage:<8} {event.event:<8} +{time.monotonic() - t0:5.1f}s{detail}", highlight=False)
        if event.event == StageEvent.STARTED:
            spinner.update(STAGE_WAIT.get(event.stage, event.stage))

    return show


@app.command()
@guarded
def adopt(name: str = NameArg):
    """Bring control back to an endpoint whose controller is gone (login node rebooted, process killed).

    A new controller adopts the router (or starts one on the same port, same key) and every replica whose
    job runs and that answers a real completion; lost ones are replaced. No running replica restarts.
    Nothing to do when its controller runs: safe to call from cron as a keep-alive.
    """
    spinner = console.status("adopting", spinner="dots")
    with spinner:
        result = api.adopt(name, on_event=stage_printer(spinner))
    adopted_report(result)


def adopted_report(result: api.UpResult) -> None:
    if result.reason and result.status is RunStatus.READY:  # its controller runs
        console.print(f"{result.name}: {result.reason}", highlight=False)
        return
    for d in result.adopted or []:
        console.print(f"  {d['action']}: {d['reason']}", highlight=False)
    if result.status is not RunStatus.READY:
        error = result.error or {}
        err.print(f"[bold red]adoption failed[/]: {error.get('diagnosis') or result.reason}", highlight=False)
        err.print(f"what ran before runs on as it was; see `hpcserve status {result.name}` and "
                  f"{error.get('log') or result.run_dir}")
        raise typer.Exit(1)
    console.print(f"[bold green]adopted[/]: {result.name} is under control again; endpoint {result.endpoint}/v1",
                  highlight=False)
    console.print(f"  stop with: hpcserve down {result.name}")


@app.command()
@guarded
def down(name: str = NameArg):
    """Stop a deployment: engines, Ray on every node, the job. Nothing stays running."""
    result = api.down(name)
    if result["left_running"]:
        err.print(f"[red]still running after stop:[/] PIDs {result['left_running']}")
        raise typer.Exit(1)
    console.print(f"stopped {name}; logs kept in {result['run_dir']}")


# ------------------------------------------------------------------ status / logs

@app.command()
@guarded
def status(name: Optional[str] = typer.Argument(None, help="one deployment; default: all"),
           as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
           watch: bool = typer.Option(False, "--watch", "-w", help="live view of nodes and replicas; Ctrl-C to stop"),
           interval: float = typer.Option(2.0, min=0.5, help="seconds between refreshes with --watch")):
    """What is really running: checked now (driver process or Slurm job, each replica's /health)."""
    if watch:
        if as_json:
            raise UsageError("--watch and --json do not go together")
        if name:
            api.load_record(name)  # an unknown name fails now, listing the known ones

        live(name, interval)
        return
    rows = api.status(name)
    if as_json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
        return
    if not rows:
        console.print("no deployments. Start one with `hpcserve up CONFIG`.")
        return
    console.print(status_view(rows))
    for r in rows:
        if r.error:
            err.print(f"{r.name}: stage '{r.error['stage']}' failed: {r.error['diagnosis']} (read {r.error.get('log')})",
                      highlight=False)


def status_view(rows: list[api.DeploymentStatus]) -> Group:
    """The deployments in a table that reads at 80 columns; for each, below it: what runs it, its
    endpoint and replicas (URLs whole), members, last decisions, results folder and where up's time went."""
    table = narrow_table("deployments", "name", "status", "stage", "replicas", left=("name", "status", "stage"))
    lines: list[str] = []
    for r in rows:
        healthy = sum(1 for x in r.replicas if x["healthy"])
        table.add_row(r.name, _colour(r.status), r.stage or "-", f"{healthy}/{len(r.replicas)} up" if r.replicas else "-")
        lines += deployment_lines(r)
    return Group(table, *(Text(line, no_wrap=True, overflow="ignore") for line in lines))


def deployment_lines(r: api.DeploymentStatus) -> list[str]:
    lines = [f"{r.name}: {r.runner}"]
    if r.advice:
        lines.append(f"  {r.advice}")
    if r.holding:
        lines.append(f"  {describe_holding(r.holding)}")
    if r.endpoint:
        lines.append(f"  endpoint {r.endpoint}/v1")
    lines += [f"  replica {x['index']}: {x['url']} {'healthy' if x['healthy'] else 'DOWN'}"
              + (f", compile cache {x['compile_cache']}" if x.get("compile_cache", "none") != "none" else "")
              for x in r.replicas]
    for m in r.members:
        ready = f", ready after {m['ready_s']:.0f} s" if m.get("ready_s") else ""
        note = f" ({m['note']})" if m.get("note") else ""
        role = f"{m['role']}, group {m['group']}" if m.get("group") else m["role"]
        lines.append(f"  member {m['name']} [{role}] {m['status']}{ready}: {m['runner']}{note}")
    for d in r.decisions[-8:]:
        when = time.strftime("%H:%M:%S", time.localtime(d["time"]))
        lines.append(f"  {when} {d['action']}: {d['reason']}")
    lines.append(f"  results folder: {r.run_dir}")
    if r.stages:
        lines.append(f"  where the time went: {breakdown_line(r.stages)}")
    return lines


def cfg_model(result: api.UpResult) -> str:
    return result.replicas[0]["model"] if result.replicas else "?"


def _colour(state: str) -> str:
    colour = {RunStatus.READY: "green", RunStatus.FAILED: "red", RunStatus.DEAD: "red",
              RunStatus.DEGRADED: "yellow", RunStatus.UNCONTROLLED: "yellow",
              RunStatus.HOLDING: "yellow"}.get(state, "cyan")
    return f"[{colour}]{state}[/]"


@app.command()
@guarded
def logs(name: str = NameArg,
         node: Optional[str] = typer.Option(None, help="only this node's files (hostname)"),
         component: Optional[str] = typer.Option(None, help="driver, slurm, ray, engine, health, monitor, timeline"),
         follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines"),
         lines: int = typer.Option(40, help="last lines of each file"),
         list_only: bool = typer.Option(False, "--list", help="only list the files")):
    """Show a deployment's logs: every node's, in one results folder."""
    files = api.log_files(name, node, component)
    if not files:
        err.print("no log files match")
        raise typer.Exit(1)
    for f in files:
        if list_only:
            print(f)
            continue
        console.rule(str(f))
        text = f.read_text(errors="replace").splitlines()
        print("\n".join(text[-lines:]))
    if follow:
        _follow(files)


def _follow(files: list[Path]) -> None:
    offsets = {f: f.stat().st_size for f in files}
    while True:
        for f in files:
            size = f.stat().st_size
            if size > offsets[f]:
                with open(f, errors="replace") as handle:
                    handle.seek(offsets[f])
                    for line in handle.read().splitlines():
                        print(f"{f.name}: {line}")
                offsets[f] = size
        time.sleep(0.5)


# ------------------------------------------------------------------ config-level commands

@app.command()
@guarded
def render(config: Path = ConfigArg, site: Optional[Path] = SiteOption):
    """Print the sbatch script `up` would submit (dry run; nothing is submitted)."""
    cfg = load_with_site(config, site)
    print(render_batch_script(cfg, config_yaml(cfg), sys.executable, Path(cfg.results_dir).resolve()), end="")


@app.command()
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


@app.command()
@guarded
def plan(config: Optional[Path] = typer.Argument(None, help="deployment YAML (see examples/local.yaml)", show_default=False),
         concurrency: Optional[int] = typer.Option(None, min=1, help="requests in flight to plan for (default: "
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


@app.command()
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


@app.command()
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


def _mount_subcommands() -> None:

    app.add_typer(sandbox_app, name="sandbox", help="A real multi-node Slurm cluster on this machine, for trying and testing.")
    app.command(help=bench.__doc__)(bench)
    app.command(help=doctor.__doc__)(doctor)
    app.command(help=monitor.__doc__)(monitor)


_mount_subcommands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
