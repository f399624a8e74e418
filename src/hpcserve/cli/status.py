"""`hpcserve status` and `hpcserve logs`: what is really running, and every log of a run (mounted by
hpcserve.cli.main)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Group
from rich.text import Text

from hpcserve import api
from hpcserve.cli.common import NameArg, console, err, guarded
from hpcserve.cli.watch import watch as live
from hpcserve.core.errors import UsageError
from hpcserve.core.logs import LEVELS, at_least
from hpcserve.core.statuses import RunStatus
from hpcserve.core.tables import narrow_table
from hpcserve.core.timeline import breakdown_line
from hpcserve.endpoint import acknowledge, describe_holding, lost_line


@guarded
def status(name: str | None = typer.Argument(None, help="one deployment; default: all"),
           as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
           watch: bool = typer.Option(False, "--watch", "-w", help="live view of nodes and replicas; Ctrl-C to stop"),
           interval: float = typer.Option(2.0, min=0.5, help="seconds between refreshes with --watch"),
           ack: bool = typer.Option(False, "--ack", help="acknowledge NAME's lost replicas: each stops counting "
                                    "(`degraded`) once a replacement serves in its place")):
    """What is really running: checked now (driver process or Slurm job, each replica's /health)."""
    if ack:
        if not name:
            raise UsageError("--ack needs the deployment's NAME")
        acknowledged = acknowledge(api.load_record(name))
        err.print(f"acknowledged: {', '.join(acknowledged)}" if acknowledged else "no lost replica to acknowledge",
                  highlight=False)
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
        up, total = (r.up, r.total) if r.total is not None else (sum(1 for x in r.replicas if x["healthy"]),
                                                                 len(r.replicas))
        table.add_row(r.name, _colour(r.status), r.stage or "-", f"{up}/{total} up" if total else "-")
        lines += deployment_lines(r)
    return Group(table, *(Text(line, no_wrap=True, overflow="ignore") for line in lines))


def deployment_lines(r: api.DeploymentStatus) -> list[str]:
    lines = [f"{r.name}: {r.runner}"]
    lost = lost_line(r.name, r.status, r.up or 0, r.total or 0, r.lost)
    if lost:
        lines.append(f"  {lost}")
    if r.advice:
        lines.append(f"  {r.advice}")
    if r.holding:
        lines.append(f"  {describe_holding(r.holding)}")
    if r.sleep:
        lines.append(f"  {r.sleep}")
    lines += [f"  swap: {line}" for line in r.swap]
    if r.admission_waiting:
        lines.append(f"  {r.admission_waiting} request(s) waiting for room in the KV caches, cached prefixes "
                     "first (serve.admit_kv_share), or for a place in the replicas' batches (tenancy: fair share)")
    if r.endpoint:
        lines.append(f"  endpoint {r.endpoint}/v1")
    if len(r.models) > 1:  # several models behind the URL: each with its state
        lines.append("  models: " + ", ".join(f"{m['name']} ({m['state']}, {m['healthy']} replica(s))"
                                              for m in r.models))
    lines += [f"  replica {x['index']}: {x['url']} "
              + ("healthy" if x["healthy"] else f"lost with {x.get('member')}" if x.get("lost") else "DOWN")
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


def _colour(state: str) -> str:
    colours: dict[str, str] = {RunStatus.READY: "green", RunStatus.FAILED: "red", RunStatus.DEAD: "red",
                               RunStatus.DEGRADED: "yellow", RunStatus.UNCONTROLLED: "yellow",
                               RunStatus.HOLDING: "yellow", RunStatus.ASLEEP: "blue", RunStatus.WAKING: "yellow"}
    colour = colours.get(state, "cyan")
    return f"[{colour}]{state}[/]"


@guarded
def logs(name: str = NameArg,
         node: str | None = typer.Option(None, help="only this node's files (hostname)"),
         component: str | None = typer.Option(None, help="driver, slurm, ray, engine, health, monitor, timeline"),
         follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines"),
         lines: int = typer.Option(40, help="last lines of each file"),
         level: str | None = typer.Option(None, help="only records at this level or above: "
                                          "DEBUG, INFO, WARNING, ERROR, CRITICAL"),
         list_only: bool = typer.Option(False, "--list", help="only list the files")):
    """Show a deployment's logs: every node's, in one results folder."""
    if level is not None and level.upper() not in LEVELS:
        raise UsageError(f"unknown level '{level}': choose one of {', '.join(LEVELS)}")
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
        if level:
            text = list(at_least(text, level))
        print("\n".join(text[-lines:]))
    if follow:
        _follow(files, level)


def _follow(files: list[Path], level: str | None = None) -> None:
    offsets = {f: f.stat().st_size for f in files}
    while True:
        for f in files:
            size = f.stat().st_size
            if size > offsets[f]:
                with open(f, errors="replace") as handle:
                    handle.seek(offsets[f])
                    new = handle.read().splitlines()
                    for line in at_least(new, level) if level else new:
                        print(f"{f.name}: {line}")
                offsets[f] = size
        time.sleep(0.5)
