"""Per-node resource sampling: one NodeSampler Ray actor on every node of a deployment.

Every second it appends one JSON line to RUN_DIR/monitor/<hostname>.jsonl: CPU and RAM of the node,
network bytes, each GPU's utilisation and memory (NVML), and the resident memory and CPU of the
engine processes it was told to watch. It starts before the engines, so model loading is sampled too.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil


def gpu_samples() -> list[dict] | None:
    """Utilisation and memory of every GPU on this node, or None where NVML is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVIDIA driver here (CPU nodes, fake GPUs)
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            out.append({"index": i, "util_pct": util.gpu, "mem_used_mb": mem.used // 2**20,
                        "mem_total_mb": mem.total // 2**20})
        return out
    finally:
        pynvml.nvmlShutdown()


def process_tree(pids: list[int]) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    return procs


class NodeSampler:
    """Use through ray.remote(NodeSampler).options(num_cpus=0, scheduling_strategy=<this node>)."""

    def __init__(self, out_dir: str, interval_s: float = 1.0):
        self.path = Path(out_dir) / f"{socket.gethostname()}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.interval_s = interval_s
        self.roots: list[int] = []
        self.watched: dict[int, psutil.Process] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def hostname(self) -> str:
        return socket.gethostname()

    def watch(self, pids: list[int]) -> None:
        """Count these processes and their descendants as the engine's."""
        self.roots += pids

    def stop(self) -> str:
        self.stopping.set()
        self.thread.join(timeout=5)
        return str(self.path)

    def _engine_usage(self) -> tuple[float, float]:
        for proc in process_tree(self.roots):  # vLLM starts its workers after the API process
            self.watched.setdefault(proc.pid, proc)
        rss = cpu = 0.0
        for proc in list(self.watched.values()):
            try:
                rss += proc.memory_info().rss
                cpu += proc.cpu_percent()  # since the previous sample of the same Process object
            except psutil.NoSuchProcess:
                self.watched.pop(proc.pid, None)
        return rss / 2**20, cpu

    def _loop(self) -> None:
        with open(self.path, "a") as out:
            while not self.stopping.is_set():
                net = psutil.net_io_counters()
                engine_rss_mb, engine_cpu = self._engine_usage()
                sample = {"time": time.time(), "host": socket.gethostname(),
                          "cpu_pct": psutil.cpu_percent(), "ram_used_mb": psutil.virtual_memory().used // 2**20,
                          "net_sent_mb": net.bytes_sent / 2**20, "net_recv_mb": net.bytes_recv / 2**20,
                          "engine_rss_mb": round(engine_rss_mb, 1), "engine_cpu_pct": round(engine_cpu, 1),
                          "gpus": gpu_samples()}
                out.write(json.dumps(sample) + "\n")
                out.flush()
                self.stopping.wait(self.interval_s)


def start_samplers(run_dir: Path, interval_s: float = 1.0) -> dict[str, object]:
    """One sampler per alive Ray node; returns hostname -> actor handle."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actors: list[Any] = [ray.remote(NodeSampler).options(  # Ray's types lack the handles' methods' .remote
        num_cpus=0, max_concurrency=4,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
    ).remote(str(run_dir / "monitor"), interval_s) for node in ray.nodes() if node["Alive"]]
    names = ray.get([a.hostname.remote() for a in actors])
    return dict(zip(names, actors))


def read_samples(run_dir: Path) -> dict[str, list[dict]]:
    """hostname -> samples, from a run folder."""
    out = {}
    for path in sorted((Path(run_dir) / "monitor").glob("*.jsonl")):
        out[path.stem] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out
