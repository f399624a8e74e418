"""Stand-in members for an endpoint's controller: the real Controller (and router) over members that are
stand-ins of a farm (hpcserve.testing.standin --count N), handed to it through its launcher seam
(deployment.runs.Launcher). Used by the scale benchmarks, never by the product.

A member "launched" here takes a free port of the farm, starts its stand-in there, and writes its run
folder's state.json as the driver does once its replica answered (status ready, the replica's URL),
optionally after `ready_after_s` (a startup). Stopping it stops the stand-in and frees the port for a
later member. Its process is the farm: like a Slurm job on a node that died, a member whose stand-in
was killed is not "gone" until it is stopped; the controller's probes must find out.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from hpcserve.core.config import DeploymentConfig
from hpcserve.core.keys import ApiKey
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import Record
from hpcserve.core.runstate import RunStateWriter
from hpcserve.core.statuses import RunKind, RunStatus, Stage
from hpcserve.deployment.runs import WithoutSlurmJob, config_yaml


class FarmClient:
    """The farm's admin API (hpcserve.testing.standin's Farm)."""

    def __init__(self, admin_url: str):
        self.admin_url = admin_url.rstrip("/")
        self.client = httpx.Client(timeout=10, trust_env=False)

    def describe(self) -> dict:
        return self.client.get(f"{self.admin_url}/farm").raise_for_status().json()

    def act(self, action: str, ports: list[int]) -> None:
        if ports:
            self.client.post(f"{self.admin_url}/farm/{action}", params=[("port", p) for p in ports]).raise_for_status()


class StandinRuns:
    """A Launcher (deployment.runs) whose members are the farm's stand-ins."""

    def __init__(self, farm_admin_url: str, host: str = "127.0.0.1", ready_after_s: float = 0.0):
        self.farm = FarmClient(farm_admin_url)
        described = self.farm.describe()
        self.pid = described["pid"]
        self.started = psutil.Process(self.pid).create_time()
        self.free = sorted(s["port"] for s in described["standins"])
        self.host, self.ready_after_s = host, ready_after_s
        self.lock = threading.Lock()
        self.alive, self.alive_checked = True, float("-inf")

    def launch(self, cfg: DeploymentConfig, results: Path, key: ApiKey, extra_env: dict[str, str]) -> Record:
        with self.lock:
            if not self.free:
                raise RuntimeError("the farm has no free stand-in left: start it with more ports")
            port = self.free.pop(0)
        self.farm.act("start", [port])
        paths = RunPaths(results / "logs" / f"{cfg.name}-standin-{port}")
        paths.root.mkdir(parents=True, exist_ok=True)
        paths.config.write_text(config_yaml(cfg))
        url = f"http://{self.host}:{port}"
        writer = RunStateWriter(paths.root)
        writer.update(status=RunStatus.STARTING, driver_pid=self.pid, standin_port=port)
        timer = threading.Timer(self.ready_after_s, ready, args=(writer, url, cfg.model.name))
        timer.daemon = True
        timer.start()
        return Record(name=cfg.name, scheduler="local", run_dir=str(paths.root), driver_pid=self.pid,
                      driver_started=self.started, kind=RunKind.DRIVER)

    def run_of(self, record: Record) -> StandinRun:
        return StandinRun(record, self)

    def slurm_queries(self) -> int | None:
        return None

    def farm_alive(self) -> bool:
        """Looked at once a second at most: the controller asks for every member in turn."""
        now = time.monotonic()
        if now - self.alive_checked > 1.0:
            self.alive, self.alive_checked = psutil.pid_exists(self.pid), now
        return self.alive

    def release(self, port: int) -> None:
        self.farm.act("stop", [port])
        with self.lock:
            if port not in self.free:
                self.free.append(port)


def ready(writer: RunStateWriter, url: str, model: str) -> None:
    """What the driver writes once its replica answered a real completion."""
    writer.begin(Stage.READY)
    writer.update(status=RunStatus.READY, replicas=[{"index": 0, "url": url, "model": model, "healthy": True,
                                                     "nodes": ["standin"]}])


@dataclass
class StandinRun(WithoutSlurmJob):
    record: Record
    runs: StandinRuns

    @property
    def port(self) -> int:
        return int(RunStateWriter(Path(self.record.run_dir)).state["standin_port"])

    def gone(self) -> str | None:
        return None if self.runs.farm_alive() else "the stand-in farm exited"

    def stop(self, timeout_s: float = 90.0, grace_s: float = 0.0) -> list[int]:
        self.runs.release(self.port)
        RunStateWriter(Path(self.record.run_dir)).update(status=RunStatus.STOPPED)
        return []

