"""Form one Ray cluster over a set of nodes: head on the first, workers on the rest.

Ready means: every expected node is alive in the GCS with the CPU and GPU counts we gave it. No fixed
sleeps: we poll with a monotonic deadline, and a node whose start process exits is reported at once,
by name, with its log.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpcserve.core.errors import StageError
from hpcserve.core.files import read_json, remove_files
from hpcserve.raycluster.auth import TOKEN_FILE, auth_env, create_token
from hpcserve.raycluster.launch import NodeLauncher
from hpcserve.raycluster.node import STOP_FILE
from hpcserve.raycluster.ports import PortBlock, free_block

# Ray's Prometheus pages answer anyone who connects, token authentication or not (~1,300 lines of
# actor names, PIDs, node addresses, the session and job ids, each process's CPU and memory). hpcserve reads
# none of them (its samplers are Ray actors that write into the run folder), so both are closed, on every
# node and in every process of the deployment (workers and engines inherit the raylet's environment):
# - the dashboard agent's metrics export port (random, on the node's address): with metrics collection
#   off, the raylet starts the agent with --disable-metrics-collection and no exporter listens;
# - the head's API server (started even with --include-dashboard=false) serves its own page on
#   DASHBOARD_METRIC_PORT, 44227 for everybody: a port it cannot bind keeps it shut (Ray logs the
#   failure in dashboard.log and goes on).
CLOSED_METRICS = {"RAY_enable_metrics_collection": "0", "DASHBOARD_METRIC_PORT": "-1"}


@dataclass
class ClusterPlan:
    nodes: list[str]  # hostnames, head first
    num_cpus: int
    num_gpus: int
    run_dir: Path
    run_id: str
    local: bool = False  # all on this machine, on loopback
    join_timeout_s: float = 120.0


@dataclass
class RayCluster:
    plan: ClusterPlan
    launcher: NodeLauncher
    ports: PortBlock | None = None
    head_address: str = ""
    temp_root: Path | None = None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def block(self) -> PortBlock:
        """The ports start() took."""
        if self.ports is None:
            raise RuntimeError("the Ray cluster has no ports before start()")
        return self.ports

    @property
    def gcs_address(self) -> str:
        return f"{self.head_address}:{self.block.gcs}"

    def environment(self) -> dict[str, str]:
        """What every process of this deployment needs to talk to this cluster (no secret values); the
        token is made here, once per run."""
        token = create_token(self.plan.run_dir)
        # No drain on SIGTERM: Ray 2.60 otherwise waits 30 s for Serve traffic we do not have; the
        # driver has stopped the engines before it stops Ray.
        env = {**auth_env(token), **CLOSED_METRICS, "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
        if self.plan.local:
            # Single node: keep every Ray address on loopback instead of the machine's public address.
            env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        return env

    def start(self) -> None:
        os.environ.update(self.environment())
        self.temp_root = new_temp_root()
        self.ports = free_block(self.plan.run_id)
        head = self.plan.nodes[0]
        self.head_address = "127.0.0.1" if self.plan.local else _address_of(head)
        # Workers are launched with the head, not after it: each waits on its own node until the head
        # listens, so srun and Python start-up overlap the head's start instead of adding to it.
        self._launch(head, "head")
        for node in self.plan.nodes[1:]:
            self._launch(node, "worker")
        self._wait_for_head()
        self.wait_ready()

    def _node_argv(self, role: str) -> list[str]:
        argv = [sys.executable, "-m", "hpcserve.raycluster.node", role, f"--run-dir={self.plan.run_dir}",
                f"--temp-root={self.temp_root}", f"--num-cpus={self.plan.num_cpus}", f"--num-gpus={self.plan.num_gpus}",
                f"--agent-port={self.block.dashboard_agent_listen}", f"--join-timeout={self.plan.join_timeout_s}"]
        if role == "head":
            argv += [f"--gcs-port={self.block.gcs}", f"--client-port={self.block.client_server}",
                     f"--address={self.head_address}"]
        else:
            argv += [f"--head={self.gcs_address}"]
            if self.plan.local:
                argv += ["--address=127.0.0.1"]
        return argv

    def _launch(self, node: str, role: str) -> None:
        log = self.node_log(node)
        self.processes[node] = self.launcher.launch(node, self._node_argv(role), log, gpus=self.plan.num_gpus)

    def node_log(self, node: str) -> Path:
        return self.plan.run_dir / "nodes" / node / "launch.log"

    def _wait_for_head(self) -> None:
        deadline = time.monotonic() + self.plan.join_timeout_s
        while True:
            self._raise_if_exited()
            try:
                with socket.create_connection((self.head_address, self.block.gcs), timeout=1):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise StageError("ray", f"the Ray head on {self.plan.nodes[0]} did not listen on "
                                 f"{self.gcs_address} within {self.plan.join_timeout_s:.0f} s",
                                 str(self.plan.run_dir / "nodes" / self.plan.nodes[0] / "ray-start.log"))
            time.sleep(0.2)

    def _raise_if_exited(self) -> None:
        for node, proc in self.processes.items():
            code = proc.poll()
            if code is not None:
                raise StageError("ray", f"the Ray process on node {node} exited with code {code} "
                                 f"before the cluster was ready: {_tail(self.node_log(node))}",
                                 str(self.node_log(node)))

    def connect(self) -> None:
        """Join the cluster as its driver. ray.init needs the raylet of this node registered with the GCS
        and gives up after 60 s; on busy cores a raylet can take longer than that after the GCS listens,
        so try again until the join timeout (a failed attempt leaves nothing behind)."""
        import ray

        deadline = time.monotonic() + self.plan.join_timeout_s
        while not ray.is_initialized():
            try:
                ray.init(address=self.gcs_address, log_to_driver=False, logging_level=logging.WARNING)
            except ConnectionError as exc:
                ray.shutdown()
                self._raise_if_exited()
                if time.monotonic() > deadline:
                    raise StageError("ray", f"could not join the Ray cluster at {self.gcs_address} within "
                                     f"{self.plan.join_timeout_s:.0f} s: {exc}",
                                     str(self.plan.run_dir / "nodes" / self.plan.nodes[0] / "ray-start.log")) from exc
                time.sleep(1)

    def wait_ready(self) -> list[dict]:
        """Poll the GCS until every node is alive with its resources; name the missing ones if not."""
        import ray

        self.connect()
        deadline = time.monotonic() + self.plan.join_timeout_s
        while True:
            self._raise_if_exited()
            alive = [n for n in ray.nodes() if n["Alive"]]
            missing = missing_nodes(self.expected_addresses(), alive, self.plan.num_cpus, self.plan.num_gpus)
            if not missing:
                return alive
            if time.monotonic() > deadline:
                node, why = missing[0]
                raise StageError("ray", f"{len(missing)} of {len(self.plan.nodes)} nodes not ready after "
                                 f"{self.plan.join_timeout_s:.0f} s; first: {node}: {why}",
                                 str(self.plan.run_dir / "nodes" / node / "ray-start.log"))
            time.sleep(0.25)

    def expected_addresses(self) -> dict[str, str | None]:
        """hostname -> address the node reported (None until its node.json exists)."""
        result = {}
        for node in self.plan.nodes:
            info = read_json(self.plan.run_dir / "nodes" / node / "node.json", {}) or {}
            result[node] = info.get("address")
        return result

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every node's Ray, workers first, the head last: each node's own process stops its Ray and
        keeps its logs when its stop file appears; the processes we launched (srun steps or local
        children) are TERMed, then KILLed, only if that fails."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        for node in reversed(self.plan.nodes):
            (self.plan.run_dir / "nodes" / node).mkdir(parents=True, exist_ok=True)
            (self.plan.run_dir / "nodes" / node / STOP_FILE).touch()
            self._wait_or_kill(self.processes.get(node), timeout_s)
        remove_files([self.plan.run_dir / TOKEN_FILE])  # a stopped cluster's token opens nothing; keep none

    @staticmethod
    def _wait_or_kill(proc: subprocess.Popen | None, timeout_s: float) -> None:
        if proc is None:
            return
        for action in (None, proc.terminate, proc.kill):
            if action:
                action()
            try:
                proc.wait(timeout=timeout_s if action is None else 10)
                return
            except subprocess.TimeoutExpired:
                continue


def new_temp_root() -> Path:
    """Where each node keeps Ray's files (TEMP_ROOT/HOSTNAME; node.py makes them 0700, checked ours).
    The name is random, not derived from the run: on a shared /tmp, a folder (or link) another user
    made in advance under a predictable name would hold Ray's sockets and session files. Short, since
    Unix socket paths are limited to 107 bytes."""
    return Path("/tmp") / f"hps-{os.getuid()}-{secrets.token_hex(6)}"


def missing_nodes(expected: dict[str, str | None], alive: list[dict], cpus: int, gpus: int) -> list[tuple[str, str]]:
    """Nodes not (yet) registered with the right resources, each with the reason. Pure."""
    by_address = {n["NodeManagerAddress"]: n for n in alive}
    missing = []
    for node, address in expected.items():
        if address is None:
            missing.append((node, "its Ray process has not started (no node.json yet): is the node up?"))
        elif address not in by_address:
            missing.append((node, f"not registered with the head from {address}"))
        else:
            res = by_address[address].get("Resources", {})
            if res.get("CPU", 0) != cpus or res.get("GPU", 0) != gpus:
                missing.append((node, (f"registered with CPU={res.get('CPU', 0)} GPU={res.get('GPU', 0)}, "
                                       f"expected CPU={cpus} GPU={gpus}")))
    return missing


def _address_of(hostname: str) -> str:
    return socket.gethostbyname(hostname)


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"
