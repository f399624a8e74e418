"""The `hpcserve` command: a thin layer over hpcserve.api. User errors exit with code 2 and one message."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from hpcserve import api
from hpcserve.cli.bench import bench
from hpcserve.cli.common import ConfigArg, NameArg, SiteOption, console, err, guarded
from hpcserve.cli.config_commands import baseline, check, plan, render, validate
from hpcserve.cli.doctor import doctor
from hpcserve.cli.monitor import monitor
from hpcserve.cli.sandbox import app as sandbox_app
from hpcserve.cli.status import logs, status
from hpcserve.cli.tenancy import app as keys_app
from hpcserve.cli.tenancy import usage
from hpcserve.core.statuses import RunStatus, Stage, StageEvent
from hpcserve.core.timeline import breakdown_line
from hpcserve.site.files import load_with_site

app = typer.Typer(
    help="Serve LLMs on HPC clusters: Slurm allocates, Ray connects the nodes, vLLM serves; each layer is "
         "checked before the next starts.\n\nStart here: `hpcserve up examples/local.yaml` (this machine, tiny model).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)

# ------------------------------------------------------------------ up / adopt / down

STAGE_WAIT: dict[str, str] = {Stage.ADOPT: "checking the router and every member's job and replicas",
                              Stage.RAY: "starting Ray on every node", Stage.HEALTH: "running the health check",
                              Stage.ENGINE: "loading the model and waiting for a real completion",
                              Stage.READY: "serving"}


@app.command()
@guarded
def up(config: Path = ConfigArg,
       timeout: float | None = typer.Option(None, help="seconds to wait for ready (default: engine.startup_timeout_s + 600)"),
       site: Path | None = SiteOption):
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
        marks: dict[str, str] = {StageEvent.STARTED: "[cyan]…[/]", StageEvent.DONE: "[green]✓[/]",
                                 StageEvent.FAILED: "[red]✗[/]"}
        mark = marks.get(event.event, "·")
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
def down(name: str = NameArg,
         member: str = typer.Option(None, "--member", show_default=False,
                                    help="only this member of an endpoint (its streams continue on the other "
                                         "replicas, the rest keep serving); `hpcserve status NAME` lists them")):
    """Stop a deployment: engines, Ray on every node, the job. Nothing stays running."""
    if member:
        done = api.down_member(name, member)
        if done["status"] not in ("gone", "failed", None):
            err.print(f"[red]{member} of {name} is still {done['status']}[/]: see `hpcserve status {name}`")
            raise typer.Exit(1)
        console.print(f"stopped {member} of {name}; the other members serve on")
        return
    result = api.down(name)
    if result["left_running"]:
        err.print(f"[red]still running after stop:[/] PIDs {result['left_running']}")
        raise typer.Exit(1)
    console.print(f"stopped {name}; logs kept in {result['run_dir']}")


def cfg_model(result: api.UpResult) -> str:
    return result.replicas[0]["model"] if result.replicas else "?"


def _mount_subcommands() -> None:
    """Every command in `hpcserve --help`'s order: serving first, then what reads or checks."""
    for command in (status, logs, render, check, plan, validate, baseline):
        app.command()(command)

    app.add_typer(keys_app, name="keys", help="Users' own keys: add, list, revoke; `keys request` gets your own.")
    app.command(help=usage.__doc__)(usage)
    app.add_typer(sandbox_app, name="sandbox", help="A real multi-node Slurm cluster on this machine, for trying and testing.")
    app.command(help=bench.__doc__)(bench)
    app.command(help=doctor.__doc__)(doctor)
    app.command(help=monitor.__doc__)(monitor)


_mount_subcommands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
