"""The distributed health check: what users otherwise check by hand before serving.

Per node: hostname, address, GPUs (the ones Ray assigned, CUDA_VISIBLE_DEVICES, NVML count and free
memory), CPUs, RAM. Between nodes: an object transfer for every ordered pair, with bandwidth; an
all-reduce over one process per GPU (NCCL, with the transport it chose) or per node (gloo on CPU),
with bus bandwidth. Scheduling: placement-group creation time and task round-trip latency.
Each failure names the node, what is wrong and the likely fix.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from rich.console import RenderableType

from hpcserve.core.tables import Notes, narrow_table, with_lines

TRANSFER_BYTES = 16 * 2**20
ALLREDUCE_BYTES = 16 * 2**20


@dataclass
class Failure:
    node: str
    what: str
    fix: str


@dataclass
class NodeReport:
    hostname: str
    address: str
    node_id: str
    cpus: int
    ram_gb: float
    ray_gpu_ids: list[str]
    cuda_visible_devices: str | None
    nvml_gpus: int | None
    gpu_free_mb: list[int]
    notes: list[str] = field(default_factory=list)


@dataclass
class Transfer:
    source: str
    destination: str
    megabytes: float
    seconds: float

    @property
    def gbit_s(self) -> float:
        return self.megabytes * 8 / 1000 / self.seconds if self.seconds else 0.0


@dataclass
class Collective:
    backend: str
    world_size: int
    megabytes: float
    seconds: float
    bus_gbit_s: float
    transport: str | None = None
    error: str | None = None


@dataclass
class HealthReport:
    nodes: list[NodeReport]
    transfers: list[Transfer]
    collective: Collective | None
    placement_group_s: float | None
    task_rtt_ms: float | None
    failures: list[Failure]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def first_failure(self) -> str:
        f = self.failures[0]
        more = f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
        return f"node {f.node}: {f.what}. Likely fix: {f.fix}{more}"

    def summary_line(self) -> str:
        bw = min((t.gbit_s for t in self.transfers), default=None)
        parts = [f"{len(self.nodes)} node(s) ok"]
        if bw is not None:
            parts.append(f"slowest pair {bw:.2f} Gbit/s")
        if self.collective and not self.collective.error and self.collective.world_size > 1:
            parts.append(f"{self.collective.backend} all-reduce {self.collective.bus_gbit_s:.2f} Gbit/s bus")
        return ", ".join(parts)

    @classmethod
    def from_dict(cls, data: dict) -> HealthReport:
        return cls(nodes=[NodeReport(**n) for n in data["nodes"]],
                   transfers=[Transfer(t["source"], t["destination"], t["megabytes"], t["seconds"]) for t in data["transfers"]],
                   collective=Collective(**data["collective"]) if data.get("collective") else None,
                   placement_group_s=data.get("placement_group_s"), task_rtt_ms=data.get("task_rtt_ms"),
                   failures=[Failure(**f) for f in data["failures"]], seconds=data.get("seconds", 0.0))

    def to_dict(self) -> dict:
        data = asdict(self)
        data["ok"] = self.ok
        for t, d in zip(self.transfers, data["transfers"]):
            d["gbit_s"] = round(t.gbit_s, 3)
        return data


# ------------------------------------------------------------------ remote probes

def _probe_node() -> dict:
    import ray

    ctx = ray.get_runtime_context()
    gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    nvml_count, free = None, []
    notes = []
    try:
        import pynvml

        pynvml.nvmlInit()
        nvml_count = pynvml.nvmlDeviceGetCount()
        for i in range(nvml_count):
            free.append(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free // 2**20)
        pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - no driver on this node: reported, judged by the caller
        notes.append(f"NVML unavailable ({type(exc).__name__})")
    return {"hostname": socket.gethostname(), "address": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
            "cpus": len(os.sched_getaffinity(0)), "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "ray_gpu_ids": gpu_ids, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "nvml_gpus": nvml_count, "gpu_free_mb": free, "notes": notes}


def _make_blob(size: int):
    import numpy as np

    return np.ones(size, dtype=np.uint8)


def _fetch(refs: list) -> float:
    import ray

    t0 = time.perf_counter()
    blob = ray.get(refs[0])
    elapsed = time.perf_counter() - t0
    del blob
    return elapsed


def _noop() -> None:
    return None


class CollectiveMember:
    """One rank of the all-reduce (an actor, so rendezvous happens among live processes)."""

    def run(self, rank: int, world: int, master: str, port: int, backend: str, nbytes: int) -> dict:
        import torch
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=60))
        device = "cuda" if backend == "nccl" else "cpu"
        tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(tensor)  # warm-up: connections are set up here
        if device == "cuda":
            torch.cuda.synchronize()
        iters = 5
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / iters
        correct = abs(float(tensor[0].item()) - world ** (iters + 1)) < 1e-3 * world ** (iters + 1)
        dist.destroy_process_group()
        return {"seconds": seconds, "correct": correct}


# ------------------------------------------------------------------ the check

def run_health_check(nodes: int, gpus_per_node: int, rendezvous_port: int, out_dir: Path | None = None,
                     timeout_s: float = 120.0, on_resources_checked: Callable[[], None] | None = None) -> HealthReport:
    """Run against the Ray cluster this process is connected to; write health.json into out_dir.

    on_resources_checked: called once the checks that take GPUs or CPUs from Ray (node probes, the
    all-reduce, a placement group) passed, before the object transfers between nodes, which take none.
    The driver starts the engines' load there, so it overlaps the rest of the check safely.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    t_start = time.monotonic()
    failures: list[Failure] = []
    alive = [n for n in ray.nodes() if n["Alive"]]
    pin = {n["NodeID"]: NodeAffinitySchedulingStrategy(n["NodeID"], soft=False) for n in alive}
    if len(alive) != nodes:
        failures.append(Failure("cluster", f"{len(alive)} Ray nodes alive, expected {nodes}",
                                "see each node's ray-start.log under nodes/ in the run folder"))

    probe = ray.remote(_probe_node)
    reports = [NodeReport(**r) for r in ray.get(
        [probe.options(num_cpus=0, num_gpus=gpus_per_node, scheduling_strategy=pin[n["NodeID"]]).remote() for n in alive],
        timeout=timeout_s)]
    failures += judge_nodes(reports, gpus_per_node)
    names = {r.node_id: r.hostname for r in reports}

    real_gpus = bool(gpus_per_node) and all(r.nvml_gpus for r in reports)
    collective = measure_collective(alive, pin, names, gpus_per_node if real_gpus else 0, rendezvous_port,
                                    out_dir, timeout_s)
    if collective.error:
        failures.append(Failure("all", f"{collective.backend} all-reduce failed: {collective.error}",
                                "check NCCL_SOCKET_IFNAME / InfiniBand setup; rerun with NCCL_DEBUG=INFO"))

    pg_s, rtt_ms = measure_scheduling(alive, pin, timeout_s)
    if on_resources_checked and not failures:
        on_resources_checked()

    transfers = measure_transfers(alive, pin, names, timeout_s)
    for t in transfers:
        if t.seconds <= 0:
            failures.append(Failure(t.source, f"object transfer to {t.destination} failed",
                                    "check that the nodes reach each other on Ray's ports (firewall, wrong NIC)"))

    report = HealthReport(reports, transfers, collective, pg_s, rtt_ms, failures, time.monotonic() - t_start)
    if out_dir is not None:
        (Path(out_dir) / "health.json").write_text(json.dumps(report.to_dict(), indent=2))
    return report


def judge_nodes(reports: list[NodeReport], gpus_per_node: int) -> list[Failure]:
    """Per-node problems, each with a likely fix. Pure."""
    failures = []
    addresses = [r.address for r in reports]
    for r in reports:
        if addresses.count(r.address) > 1:
            failures.append(Failure(r.hostname, f"shares address {r.address} with another node",
                                    "start Ray with each node's own address (multi-NIC node?)"))
        if len(r.ray_gpu_ids) != gpus_per_node:
            failures.append(Failure(r.hostname, f"Ray assigned {len(r.ray_gpu_ids)} GPUs, expected {gpus_per_node}",
                                    "request --gpus-per-node in the job and pass --num-gpus to ray start"))
        if r.nvml_gpus is not None and gpus_per_node and r.nvml_gpus < gpus_per_node:
            failures.append(Failure(r.hostname, f"NVML sees {r.nvml_gpus} GPUs, expected {gpus_per_node}",
                                    "check CUDA_VISIBLE_DEVICES and the job's GPU request"))
    return failures


def measure_transfers(alive: list[dict], pin: dict, names: dict, timeout_s: float) -> list[Transfer]:
    import ray

    if len(alive) < 2:
        return []
    make, fetch = ray.remote(_make_blob), ray.remote(_fetch)
    results = []
    for src in alive:
        blob = make.options(num_cpus=0, scheduling_strategy=pin[src["NodeID"]]).remote(TRANSFER_BYTES)
        ray.wait([blob], fetch_local=False, timeout=timeout_s)
        for dst in alive:
            if dst is src:
                continue
            try:
                seconds = ray.get(fetch.options(num_cpus=0, scheduling_strategy=pin[dst["NodeID"]]).remote([blob]),
                                  timeout=timeout_s)
            except Exception:  # noqa: BLE001 - recorded as a failed pair
                seconds = 0.0
            results.append(Transfer(names.get(src["NodeID"], src["NodeManagerAddress"]),
                                    names.get(dst["NodeID"], dst["NodeManagerAddress"]), TRANSFER_BYTES / 2**20, seconds))
        del blob
    return results


def measure_collective(alive, pin, names, gpus_per_node, port, out_dir, timeout_s) -> Collective:
    """NCCL over one rank per GPU where NVML sees real GPUs; otherwise gloo over one rank per node."""
    import ray

    backend = "nccl" if gpus_per_node else "gloo"
    per_node = gpus_per_node or 1
    world = len(alive) * per_node
    master = _head_first(alive)[0]["NodeManagerAddress"]
    env = {}
    if backend == "nccl" and out_dir is not None:
        env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": f"{out_dir}/nccl.%h.%p.log"}
    member_cls = ray.remote(CollectiveMember)
    members: list[Any] = []  # Ray's handles: Ray's types lack their methods' .remote
    for node in _head_first(alive):
        for _ in range(per_node):
            members.append(member_cls.options(num_cpus=0, num_gpus=1 if gpus_per_node else 0,
                                              scheduling_strategy=pin[node["NodeID"]],
                                              runtime_env={"env_vars": env} if env else None).remote())
    try:
        results = ray.get([m.run.remote(rank, world, master, port, backend, ALLREDUCE_BYTES)
                           for rank, m in enumerate(members)], timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - reported as the check's failure
        return Collective(backend, world, ALLREDUCE_BYTES / 2**20, 0.0, 0.0, error=f"{type(exc).__name__}: {exc}"[:300])
    finally:
        for m in members:
            ray.kill(m)
    seconds = max(r["seconds"] for r in results)
    bus = bus_bandwidth_gbit(ALLREDUCE_BYTES, world, seconds)
    error = None if all(r["correct"] for r in results) else "wrong sum"
    transport = nccl_transport(Path(out_dir)) if backend == "nccl" and out_dir is not None else None
    return Collective(backend, world, ALLREDUCE_BYTES / 2**20, seconds, bus, transport, error)


def bus_bandwidth_gbit(nbytes: int, world: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: 2(n-1)/n x size / time. Pure."""
    if seconds <= 0:
        return 0.0
    factor = 2 * (world - 1) / world if world > 1 else 1.0
    return factor * nbytes * 8 / 1e9 / seconds


TRANSPORT = re.compile(r"via (NET/IB\S*|NET/Socket\S*|P2P/\S+|SHM\S*|NVLS)")


def nccl_transport(out_dir: Path) -> str | None:
    """The transports NCCL reported choosing (socket vs InfiniBand vs P2P/NVLink), from its logs."""
    seen = set()
    for log in out_dir.glob("nccl.*.log"):
        for match in TRANSPORT.finditer(log.read_text(errors="replace")):
            seen.add("/".join(match.group(1).split("/")[:2]))
    return ", ".join(sorted(seen)) or None


def measure_scheduling(alive, pin, timeout_s) -> tuple[float | None, float | None]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    t0 = time.perf_counter()
    pg = placement_group([{"CPU": 0.01}] * len(alive), strategy="STRICT_SPREAD")
    placed = pg.wait(timeout_seconds=timeout_s)
    pg_s = time.perf_counter() - t0 if placed else None
    remove_placement_group(pg)
    noop = ray.remote(_noop)
    rtts = []
    for node in alive:
        for _ in range(3):
            t = time.perf_counter()
            ray.get(noop.options(num_cpus=0, scheduling_strategy=pin[node["NodeID"]]).remote(), timeout=timeout_s)
            rtts.append((time.perf_counter() - t) * 1000)
    return pg_s, statistics.median(rtts) if rtts else None


def _head_first(alive: list[dict]) -> list[dict]:
    return sorted(alive, key=lambda n: not n.get("Resources", {}).get("node:__internal_head__"))


def render_table(report: HealthReport) -> RenderableType:
    """Per node: CPUs, RAM, GPUs as Ray and NVML see them, CUDA_VISIBLE_DEVICES; notes below. 80 columns."""
    table = narrow_table(f"health check: {'OK' if report.ok else 'FAILED'} ({report.seconds:.1f} s)",
                         "node", "address", "CPUs", "RAM GiB", "GPUs Ray/NVML", "visible", "notes",
                         left=("node", "address", "visible", "notes"))
    notes = Notes()
    for r in report.nodes:
        nvml = "-" if r.nvml_gpus is None else str(r.nvml_gpus)
        table.add_row(r.hostname, r.address, str(r.cpus), str(r.ram_gb), f"{len(r.ray_gpu_ids)}/{nvml}",
                      r.cuda_visible_devices or "-", notes.add("; ".join(r.notes)))
    return with_lines(table, ["visible: CUDA_VISIBLE_DEVICES", *notes.lines()])


def render_lines(report: HealthReport) -> list[str]:
    lines = [f"transfer {t.source} -> {t.destination}: {t.gbit_s:.2f} Gbit/s" for t in report.transfers]
    c = report.collective
    if c:
        lines.append(f"all-reduce ({c.backend}, {c.world_size} ranks, {c.megabytes:.0f} MB): "
                     + (f"error: {c.error}" if c.error else f"{c.bus_gbit_s:.2f} Gbit/s bus bandwidth")
                     + (f", transport {c.transport}" if c.transport else ""))
    if report.placement_group_s is not None:
        lines.append(f"placement group over {len(report.nodes)} node(s): {report.placement_group_s * 1000:.0f} ms")
    if report.task_rtt_ms is not None:
        lines.append(f"task round trip: {report.task_rtt_ms:.1f} ms (median)")
    lines += [f"FAIL {f.node}: {f.what}. Fix: {f.fix}" for f in report.failures]
    return lines
