"""The deployment driver: `python -m hpcserve.deployment.driver RUN_DIR`, one per deployment.

Runs inside the Slurm job (the batch script execs it) or, in local mode, as a detached process on
this machine. It takes the deployment through its stages, each validated before the next:

    ray     one Ray cluster over the nodes (head first, then workers), every node registered
    health  the distributed health check
    engine  the replicas' vLLM processes, ready only after a real completion through the endpoint
    ready   serving; then it watches the engines until told to stop (SIGTERM) or an engine dies

Progress goes to RUN_DIR/timeline.json and RUN_DIR/state.json. On SIGTERM or any failure it stops
what it started, in reverse order, and exits; nothing stays behind.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from hpcserve.core.config import DeploymentConfig, load_config
from hpcserve.core.errors import StageError, UnsafePathError
from hpcserve.core.folders import private_dir
from hpcserve.core.paths import RunPaths
from hpcserve.core.runstate import RunStateWriter
from hpcserve.core.statuses import RunStatus, Stage
from hpcserve.deployment.process import install_notice_handler, install_stop_handlers, process_main, run_to_end
from hpcserve.deployment.runs import CHECK_ONLY_ENV
from hpcserve.engine.client import READY_PROMPT
from hpcserve.engine.load_format import choose, load_format_args
from hpcserve.engine.replicas import ReplicaSet, engine_key
from hpcserve.monitoring.sampler import start_samplers
from hpcserve.planning.model_source import model_and_layout, resolve_model_path
from hpcserve.raycluster.cluster import ClusterPlan, RayCluster
from hpcserve.raycluster.health import run_health_check
from hpcserve.raycluster.launch import LocalLauncher, SrunLauncher
from hpcserve.slurm.parse import expand_nodelist

WATCH_INTERVAL_S = 2.0

log = logging.getLogger(__name__)


def job_nodes(local: bool) -> list[str]:
    if local:
        return [socket.gethostname()]

    return expand_nodelist(os.environ["SLURM_JOB_NODELIST"])


def run(run_dir: Path) -> int:
    try:
        private_dir(run_dir)  # ours, no link, closed to others: else nothing in it can be trusted
    except UnsafePathError as exc:
        log.error("%s", exc)
        return 2
    paths = RunPaths(run_dir)
    cfg = load_config(paths.config)
    writer = RunStateWriter(run_dir)
    # In a job the driver replaced the batch shell (exec): its process start is the job's start.
    writer.update(driver_pid=os.getpid(), driver_host=socket.gethostname(), status=RunStatus.STARTING,
                  job_started=psutil.Process().create_time())
    own_log = paths.driver_log if cfg.cluster.scheduler == "local" else paths.slurm_out
    parts = Deployment()
    install_stop_handlers()
    install_notice_handler(run_dir)
    return run_to_end(writer, lambda: serve(cfg, parts, run_dir, writer), lambda: teardown(parts), own_log,
                      Stage.RAY)


def serve(cfg: DeploymentConfig, parts: Deployment, run_dir: Path, writer: RunStateWriter) -> None:
    """The stages, each proven before the next; then serve until stopped."""
    os.environ.update(cfg.engine.env)  # reaches every node's Ray, hence every engine worker
    start_ray(cfg, parts, run_dir, writer)
    install_stop_handlers()  # ray.init replaced them with handlers that only log and die
    install_notice_handler(run_dir)
    parts.samplers = start_samplers(run_dir)
    check_only = bool(os.environ.get(CHECK_ONLY_ENV))
    # The engines' load (tens of seconds to minutes) starts as soon as the checks that need the
    # nodes' GPUs and CPUs passed, and overlaps the rest of the health check. Not with swap: its engines
    # start one after another, each waited for, which would hold the check up for minutes.
    early = not check_only and cfg.swap is None
    start_early = (lambda: start_engines(cfg, parts, run_dir, writer)) if early else None
    check_health(cfg, parts.cluster, run_dir, writer, start_early)
    if check_only:
        writer.update(status=RunStatus.CHECKED)
        return
    if parts.replicas is None:
        start_engines(cfg, parts, run_dir, writer)
    wait_engines_ready(cfg, parts.replicas, writer)
    writer.begin(Stage.READY)
    writer.update(status=RunStatus.READY)
    watch(parts.replicas)


@dataclass
class Deployment:
    """What the driver started, for teardown in reverse order."""

    cluster: RayCluster | None = None
    samplers: dict = field(default_factory=dict)
    replicas: ReplicaSet | None = None


def start_ray(cfg: DeploymentConfig, parts: Deployment, run_dir: Path, writer: RunStateWriter) -> None:
    local = cfg.cluster.scheduler == "local"
    nodes = job_nodes(local)
    writer.begin("ray", f"{len(nodes)} node(s): {', '.join(nodes)}")
    plan = ClusterPlan(nodes=nodes, num_cpus=cfg.cluster.cpus_per_node, num_gpus=cfg.cluster.gpus_per_node,
                       run_dir=run_dir, run_id=run_dir.name, local=local)
    cluster = parts.cluster = RayCluster(plan, LocalLauncher() if local else SrunLauncher())  # stopped even half-started
    cluster.start()
    writer.update(ray={"gcs": cluster.gcs_address, "nodes": cluster.expected_addresses(),
                         "pids": {n: p.pid for n, p in cluster.processes.items()}})
    writer.done("ray")


def check_health(cfg: DeploymentConfig, cluster, run_dir: Path, writer: RunStateWriter,
                 on_resources_checked=None) -> None:

    writer.begin("health")
    report = run_health_check(nodes=len(cluster.plan.nodes), gpus_per_node=cfg.cluster.gpus_per_node,
                              rendezvous_port=cluster.ports.collective, out_dir=run_dir,
                              on_resources_checked=on_resources_checked)
    if not report.ok:
        raise StageError("health", report.first_failure(), str(RunPaths(run_dir).health))
    writer.done("health", report.summary_line())


def start_engines(cfg: DeploymentConfig, parts: Deployment, run_dir: Path, writer: RunStateWriter) -> None:
    """Start every replica's engines, watched by the samplers; returns while they load."""
    model_path, layout = model_and_layout(cfg)
    if parts.cluster is None:
        raise RuntimeError("the engines start on the Ray cluster start_ray started")
    master_port, gcs_address = parts.cluster.block.engine_master, parts.cluster.gcs_address  # what they need of Ray
    loader = choose(cfg.engine.load_format, cfg.engine.args, cfg.on_gpu)
    writer.begin("engine", f"{layout.replicas} replica(s) of tensor {layout.tensor} x pipeline {layout.pipeline}; "
                 f"weights: {loader.reason}")
    api_key = engine_key(cfg, run_dir)
    swap_models = [(spec, resolve_model_path(cfg.model_copy(update={"model": spec})))
                   for spec in (cfg.swap.models if cfg.swap else [])]
    replicas = ReplicaSet(cfg, layout, model_path, run_dir, api_key, master_port, gcs_address,
                          load_format_args(loader), swap_models)
    parts.replicas = replicas  # torn down even if it fails half-way
    replicas.start()
    for proc in replicas.processes():
        parts.samplers[proc.hostname].watch.remote([proc.pid])
    writer.update(replicas=replicas.rows(healthy=False), swap=replicas.swap_rows())


def wait_engines_ready(cfg: DeploymentConfig, replicas, writer: RunStateWriter) -> None:
    """Ready only after a real completion came back from every replica."""
    writer.update(stage="engine")
    answers = replicas.wait_ready(cfg.engine.startup_timeout_s)
    writer.done("engine")
    writer.update(replicas=replicas.rows(healthy=True), ready_check={"prompt": READY_PROMPT, "answers": answers})


def watch(replicas) -> None:
    """Serve until stopped; an engine that dies marks the deployment failed (status never lies)."""
    while True:
        replicas.raise_if_dead()
        time.sleep(WATCH_INTERVAL_S)


def teardown(parts: Deployment) -> None:
    if parts.samplers:
        import ray

        try:
            ray.get([s.stop.remote() for s in parts.samplers.values()], timeout=10)
        except Exception:  # noqa: BLE001, S110 - samples so far are on disk already
            pass
    if parts.replicas is not None:
        try:
            parts.replicas.stop()
        except Exception:  # keep going: the cluster must stop regardless
            log.exception("stopping the engines failed")
    if parts.cluster is not None:
        parts.cluster.stop()


if __name__ == "__main__":
    process_main(run, "hpcserve.deployment.driver")
