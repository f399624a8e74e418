"""The replicas behind an endpoint come in members: each member is one ordinary deployment (a Slurm job,
or a driver process in local mode) that serves one or more replicas. The endpoint's controller launches
members, watches them, and puts their replicas into the router once they answered a real completion.

A member runs the same driver as a deployment without a router, so a member alone is proven by the
same tests; here are the member's settings (its own name, ports and run folder) and what the controller
reads back from it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from hpcserve.core.config import BurstSpec, ClusterSpec, DeploymentConfig, Layout
from hpcserve.core.config_checks import slots_per_node
from hpcserve.core.files import read_json
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import Record
from hpcserve.core.runstate import RunState, read_timeline
from hpcserve.core.statuses import MemberRole, MemberStatus
from hpcserve.engine.capacity import max_num_seqs
from hpcserve.engine.replicas import replica_shapes

# Replica ports of member slot k: serve.port + 1 + k * PORTS_PER_MEMBER + replica index. A slot is
# reused once its member is gone, so the ports of a long-lived endpoint stay within a small window.
PORTS_PER_MEMBER = 8


@dataclass
class Member:
    name: str
    slot: int
    role: MemberRole
    layout: dict
    record: dict  # the member's state.Record, as a dict (JSON in the controller's state)
    launched: float = field(default_factory=time.time)
    status: MemberStatus = MemberStatus.LAUNCHING
    backends: list[str] = field(default_factory=list)
    ready_s: float | None = None  # launch (submission) to serving: queue wait and startup
    job_started: float | None = None  # when its job (or local driver) started, epoch seconds
    startup_s: float | None = None  # its job's start to serving: what the walltime handover plans with
    under_load: bool = False  # the endpoint served requests while it started
    replaces: str | None = None
    successor: str | None = None
    error: dict | None = None
    note: str = ""
    retired: bool = False  # drained on purpose (scaled down, handed over): not replaced
    end_time: str | None = None  # Slurm's EndTime of its job (the time limit), for the handover
    group: int = 0  # 0: parallelism's shape; k: replica_groups[k - 1]
    burst: bool = False  # on autoscale.burst's preemptible partition

    def notice(self) -> dict | None:
        """What its job told the controller (deployment.process.write_notice), None before anything."""
        return read_json(RunPaths(self.run_dir).notice)

    def __post_init__(self) -> None:
        self.role, self.status = MemberRole(self.role), MemberStatus(self.status)

    @property
    def run_dir(self) -> Path:
        return Path(self.record["run_dir"])

    def as_record(self) -> Record:
        return Record.from_dict(self.record)

    def state(self) -> RunState:
        """What its driver wrote last."""
        return RunState.read(self.run_dir)

    def timeline(self) -> list[dict]:
        return read_timeline(self.run_dir)

    def to_json(self) -> dict:
        """Its fields as they are (no deep copy: the caller serialises at once; asdict of 256 members
        took ~40 ms a round)."""
        return {name: getattr(self, name) for name in MEMBER_FIELDS}

    @classmethod
    def from_json(cls, data: dict) -> Member:
        return cls(**data)


MEMBER_FIELDS = tuple(f.name for f in fields(Member))


def member_config(cfg: DeploymentConfig, name: str, slot: int, layout: Layout, results_dir: Path,
                  group: int = 0, burst: bool = False) -> DeploymentConfig:
    """The deployment a member runs: the endpoint's (changed as its replica group says), with its own
    name, ports and results folder, and no router, join, autoscaler or groups of its own. On Slurm its engines
    listen on every address of their node (the router on the submit host must reach them); the API key
    guards them."""
    serve = cfg.serve.model_copy(update={
        "router": False, "join": None, "port": cfg.serve.port + 1 + slot * PORTS_PER_MEMBER,
        "host": "0.0.0.0" if cfg.cluster.scheduler == "slurm" else cfg.serve.host})
    cluster, engine = cfg.cluster, cfg.engine
    if group:
        spec = cfg.replica_groups[group - 1]
        cluster = spec.cluster(cluster)
        engine = engine.model_copy(update={"args": [*engine.args, *spec.engine_args]})
    # Its engines sleep as the endpoint's model does (the member has no autoscale of its own to say it)
    engine = engine.model_copy(update={"sleep_mode": "on" if cfg.engine_sleeps else "off"})
    if burst and cfg.autoscale and cfg.autoscale.burst:
        cluster = burst_cluster(cluster, cfg.autoscale.burst)
    nodes = sum(shape.nnodes for shape in replica_shapes(layout, slots_per_node(cluster)))
    cluster = cluster.model_copy(update={"nodes": nodes})
    return cfg.model_copy(update={"name": name, "serve": serve, "parallelism": layout, "autoscale": None,
                                  "replica_groups": [], "cluster": cluster, "engine": engine,
                                  "results_dir": str(results_dir)})


def burst_cluster(cluster: ClusterSpec, burst: BurstSpec) -> ClusterSpec:
    """A burst member's job: on the preemptible partition (and QOS), with a signal to its batch script (the
    member itself) at preemption and ahead of its time limit, which it tells the controller."""
    return cluster.model_copy(update={
        "partition": burst.partition, "qos": burst.qos or cluster.qos,
        "sbatch_extra": [*cluster.sbatch_extra, f"--signal=B:USR1@{burst.signal_s}"]})


def member_capacity(cfg: DeploymentConfig, group: int) -> int:
    """Requests one replica of a member of this group runs at once (its engine's --max-num-seqs): the
    data plane gives each replica traffic in proportion to it."""
    extra = cfg.replica_groups[group - 1].engine_args if group else []
    return max_num_seqs([*cfg.engine.args, *extra])


def group_layouts(cfg: DeploymentConfig, base: Layout) -> list[tuple[int, Layout]]:
    """The initial members: (group, one replica's layout) for each replica, parallelism's first."""
    members = [(0, single_replica(base))] * base.replicas
    for index, spec in enumerate(cfg.replica_groups, start=1):
        members += [(index, spec.layout(base))] * spec.replicas
    return members


def free_slot(members: list[Member]) -> int:
    taken = {m.slot for m in members if m.status not in (MemberStatus.GONE, MemberStatus.FAILED)}
    return next(slot for slot in range(len(members) + 1) if slot not in taken)


def single_replica(layout: Layout) -> Layout:
    """What autoscaling and replacements add: one more replica of the same shape."""
    return Layout(tensor=layout.tensor, pipeline=layout.pipeline, replicas=1)


def replica_urls(state: RunState) -> list[str]:
    return [r["url"] for r in state.replicas]


def pool_replicas(members: list[Member], model: str, described: dict[str, list[dict]] | None = None) -> list[dict]:
    """Every replica behind the router, as its member's driver describes it (nodes, processes, logs),
    numbered across the endpoint and named by member; healthy: its member serves (in the pool).
    described: member -> its replicas as read when it joined (else its state.json is read now)."""
    out: list[dict] = []
    for member in members:
        if not member.backends:
            continue
        rows = (described or {}).get(member.name)
        described_now = {r["url"]: r for r in (rows if rows is not None else member.state().replicas)}
        for url in member.backends:
            out.append({**described_now.get(url, {}), "index": len(out), "url": url, "member": member.name,
                        "model": model, "healthy": member.status is MemberStatus.SERVING})
    return out
