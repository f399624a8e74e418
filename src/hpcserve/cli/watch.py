"""`hpcserve status --watch`: a live terminal view of one deployment (or all), refreshed every interval,
from the same Gatherer as the monitor server. Ctrl-C ends it."""

from __future__ import annotations

import time

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from hpcserve import api
from hpcserve.core.registry import list_names
from hpcserve.core.statuses import RunStatus
from hpcserve.core.tables import narrow_table
from hpcserve.monitoring.metrics import Gatherer, NodeMetrics, ReplicaMetrics, Snapshot

STATUS_STYLE = {RunStatus.READY: "green", RunStatus.FAILED: "red", RunStatus.DEAD: "red", "unknown": "red",
                RunStatus.DEGRADED: "yellow", RunStatus.UNCONTROLLED: "yellow", RunStatus.HOLDING: "yellow"}


def _num(value: float | None, digits: int = 1, unit: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _mib(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1024:.1f} GiB" if value >= 1024 else f"{value:.0f} MiB"


def replica_state(r: ReplicaMetrics) -> Text:
    if r.up and r.healthy is not False:
        return Text("healthy", style="green")
    return Text("unhealthy" if r.up else "DOWN", style="red")


def gpus_cell(sample: dict) -> str:
    gpus = sample.get("gpus")
    if not gpus:
        return "none"
    return "\n".join(f"{g['index']}: {g['util_pct']}% {_gib(g['mem_used_mb'])}/{_gib(g['mem_total_mb'])}" for g in gpus)


def _gib(mib: float | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f}"


def node_table(nodes: list[NodeMetrics]) -> Table:
    """Memory in GiB, CPU in %; a GPU as index: utilisation used/total GiB."""
    table = narrow_table("nodes", "node", "CPU %", "RAM", "engine", "engine CPU %", "GPUs", "sample",
                         left=("node", "GPUs", "sample"))
    for n in nodes:
        s = n.latest or {}
        age = "none" if n.age_s is None else f"{n.age_s:.0f} s ago"
        table.add_row(n.host, _num(s.get("cpu_pct")), _gib(s.get("ram_used_mb")), _gib(s.get("engine_rss_mb")),
                      _num(s.get("engine_cpu_pct")), gpus_cell(s),
                      Text(f"stale: {age}", style="red") if n.stale else age)
    return table


def replica_table(replicas: list[ReplicaMetrics]) -> Table:
    """Figures per replica; their URLs are listed whole below the table (replica_urls)."""
    table = narrow_table("replicas", "replica", "state", "running", "waiting", "KV cache", "gen tok/s",
                         "prompt tok/s", left=("state",))
    for r in replicas:
        kv = "-" if r.kv_cache_usage is None else f"{100 * r.kv_cache_usage:.1f} %"
        table.add_row(str(r.index), replica_state(r), _num(r.running, 0), _num(r.waiting, 0), kv,
                      _num(r.generation_tokens_per_s), _num(r.prompt_tokens_per_s))
    return table


def replica_urls(replicas: list[ReplicaMetrics]) -> list[Text]:
    return [Text(f"replica {r.index}: {r.url}", no_wrap=True, overflow="ignore") for r in replicas]


def render(snapshot: Snapshot) -> Group:
    """One deployment's view. Pure."""
    d = snapshot.deployment
    style = STATUS_STYLE.get(str(d.get("status")), "cyan")
    head = Text.assemble((f"{d['name']} ", "bold"), (str(d.get("status")), style),
                         f"  stage {d.get('stage') or '-'}  {d.get('runner') or ''}")
    parts: list[RenderableType] = [head]
    if d.get("error"):
        parts.append(Text(f"stage '{d['error'].get('stage')}' failed: {d['error'].get('diagnosis')}", style="red"))
    parts += [replica_table(snapshot.replicas), *replica_urls(snapshot.replicas), node_table(snapshot.nodes)]
    errors = [f"replica {r.index}: {r.error}" for r in snapshot.replicas if r.error]
    parts += [Text(line, style="dim") for line in errors]
    return Group(*parts)


def render_all(snapshots: list[Snapshot], interval: float) -> Group:
    if not snapshots:
        return Group(Text("no deployments. Start one with `hpcserve up CONFIG`."))
    footer = Text(f"{time.strftime('%H:%M:%S')}  refreshed every {interval:g} s; Ctrl-C to stop", style="dim")
    return Group(*[render(s) for s in snapshots], footer)


def watch(name: str | None, interval: float = 2.0, console: Console | None = None,
          iterations: int | None = None) -> None:
    """Show one deployment (or every registered one) until Ctrl-C (or `iterations` refreshes, for tests)."""
    gatherers: dict[str, Gatherer] = {}

    def frame() -> Group:
        names = [name] if name else list_names()
        for n in names:
            gatherers.setdefault(n, api.gatherer(n, max_age_s=0.0))
        return render_all([gatherers[n].snapshot() for n in names], interval)

    count = 0
    try:
        with Live(frame(), console=console, auto_refresh=False) as live:
            while iterations is None or count < iterations:
                deadline = time.monotonic() + interval
                time.sleep(max(0.0, deadline - time.monotonic()))
                live.update(frame(), refresh=True)
                count += 1
    except KeyboardInterrupt:
        pass
    finally:
        for gatherer in gatherers.values():
            gatherer.close()
