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

import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from hpcserve.core.config import DeploymentConfig, Layout, load_config
from hpcserve.core.errors import HpcserveError, StageError
from hpcserve.core.state import read_api_key
from hpcserve.core.timeline import Progress

WATCH_INTERVAL_S = 2.0
CHECK_ONLY_ENV = "HPCSERVE_CHECK_ONLY"  # `hpcserve check`: stop after the health stage


class Stop(Exception):
    """SIGTERM/SIGINT arrived: wind down."""


def _raise_stop(signum, _frame):
    raise Stop(signal.Signals(signum).name)


def install_stop_handlers() -> None:
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)


def job_nodes(local: bool) -> list[str]:
    if local:
        return [socket.gethostname()]
    from hpcserve.slurm.parse import expand_nodelist

    return expand_nodelist(os.environ["SLURM_JOB_NODELIST"])


def run(run_dir: Path) -> int:
    cfg = load_config(run_dir / "config.yaml")
    progress = Progress(run_dir)
    # In a job the driver replaced the batch shell (exec): its process start is the job's start.
    progress.update(driver_pid=os.getpid(), driver_host=socket.gethostname(), status="starting",
                    job_started=psutil.Process().create_time())
    own_log = str(run_dir / ("driver.log" if cfg.cluster.scheduler == "local" else "slurm.out"))
    parts = Deployment()
    try:
        install_stop_handlers()
        os.environ.update(cfg.engine.env)  # reaches every node's Ray, hence every engine worker
        start_ray(cfg, parts, run_dir, progress)
        install_stop_handlers()  # ray.init replaced them with handlers that only log and die
        from hpcserve.monitoring.sampler import start_samplers

        parts.samplers = start_samplers(run_dir)
        check_only = bool(os.environ.get(CHECK_ONLY_ENV))
        # The engines' load (tens of seconds to minutes) starts as soon as the checks that need the
        # nodes' GPUs and CPUs passed, and overlaps the rest of the health check.
        start_early = None if check_only else lambda: start_engines(cfg, parts, run_dir, progress)
        check_health(cfg, parts.cluster, run_dir, progress, start_early)
        if check_only:
            progress.update(status="checked")
            return 0
        if parts.replicas is None:
            start_engines(cfg, parts, run_dir, progress)
        wait_engines_ready(cfg, parts.replicas, progress)
        progress.begin("ready")
        progress.update(status="ready")
        watch(parts.replicas)
        return 0
    except Stop as why:
        progress.update(status="stopping", stop_reason=str(why))
        return 0
    except StageError as exc:
        progress.fail(exc.stage, exc.diagnosis, exc.log)
        return 1
    except HpcserveError as exc:
        progress.fail(progress.state.get("stage", "ray"), str(exc), own_log)
        return 1
    except Exception as exc:  # noqa: BLE001 - any other failure is still reported by stage
        traceback.print_exc()
        progress.fail(progress.state.get("stage", "ray"), f"{type(exc).__name__}: {exc}", own_log)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish tearing down even if signalled again
        teardown(parts)
        if progress.state.get("status") not in ("failed", "checked"):
            progress.update(status="stopped")
        progress.done("stopped")


@dataclass
class Deployment:
    """What the driver started, for teardown in reverse order."""

    cluster: object = None
    samplers: dict = field(default_factory=dict)
    replicas: object = None


def start_ray(cfg: DeploymentConfig, parts: Deployment, run_dir: Path, progress: Progress) -> None:
    from hpcserve.raycluster.cluster import ClusterPlan, RayCluster
    from hpcserve.raycluster.launch import LocalLauncher, SrunLauncher

    local = cfg.cluster.scheduler == "local"
    nodes = job_nodes(local)
    progress.begin("ray", f"{len(nodes)} node(s): {', '.join(nodes)}")
    plan = ClusterPlan(nodes=nodes, num_cpus=cfg.cluster.cpus_per_node, num_gpus=cfg.cluster.gpus_per_node,
                       run_dir=run_dir, run_id=run_dir.name, local=local)
    cluster = parts.cluster = RayCluster(plan, LocalLauncher() if local else SrunLauncher())  # stopped even half-started
    cluster.start()
    progress.update(ray={"gcs": cluster.gcs_address, "nodes": cluster.expected_addresses(),
                         "pids": {n: p.pid for n, p in cluster.processes.items()}})
    progress.done("ray")


def check_health(cfg: DeploymentConfig, cluster, run_dir: Path, progress: Progress,
                 on_resources_checked=None) -> None:
    from hpcserve.raycluster.health import run_health_check

    progress.begin("health")
    report = run_health_check(nodes=len(cluster.plan.nodes), gpus_per_node=cfg.cluster.gpus_per_node,
                              rendezvous_port=cluster.ports.collective, out_dir=run_dir,
                              on_resources_checked=on_resources_checked)
    if not report.ok:
        raise StageError("health", report.first_failure(), str(run_dir / "health.json"))
    progress.done("health", report.summary_line())


def start_engines(cfg: DeploymentConfig, parts: Deployment, run_dir: Path, progress: Progress) -> None:
    """Start every replica's engines, watched by the samplers; returns while they load."""
    from hpcserve.deployment.preflight import model_config_for, resolve_model_path
    from hpcserve.deployment.replicas import ReplicaSet

    model_path = resolve_model_path(cfg)
    layout = resolve_layout(cfg, model_config_for(cfg, model_path))
    progress.begin("engine", f"{layout.replicas} replica(s) of tensor {layout.tensor} x pipeline {layout.pipeline}")
    api_key = os.environ.get(cfg.serve.api_key_env or "", "") or read_api_key(run_dir)
    replicas = ReplicaSet(cfg, layout, model_path, run_dir, api_key, parts.cluster.ports.engine_master,
                          parts.cluster.gcs_address)
    parts.replicas = replicas  # torn down even if it fails half-way
    replicas.start()
    for proc in replicas.processes():
        parts.samplers[proc.hostname].watch.remote([proc.pid])
    progress.update(replicas=describe(replicas, cfg, healthy=False))


def wait_engines_ready(cfg: DeploymentConfig, replicas, progress: Progress) -> None:
    """Ready only after a real completion came back from every replica."""
    from hpcserve.engine.client import READY_PROMPT

    progress.update(stage="engine")
    answers = replicas.wait_ready(cfg.engine.startup_timeout_s)
    progress.done("engine")
    progress.update(replicas=describe(replicas, cfg, healthy=True),
                    ready_check={"prompt": READY_PROMPT, "answers": answers})


def describe(replicas, cfg: DeploymentConfig, healthy: bool) -> list[dict]:
    return [{**r.describe(), "model": cfg.model.name, "healthy": healthy} for r in replicas.replicas]


def resolve_layout(cfg: DeploymentConfig, model_config: dict | None) -> Layout:
    if isinstance(cfg.parallelism, Layout):
        return cfg.parallelism
    from hpcserve.planning.planner import plan_for_config

    if model_config is None:
        raise StageError("engine", "parallelism 'auto' needs the model's config.json; give a local model folder, "
                         "name the model in model.catalog, or set tensor/pipeline/replicas", None)
    return plan_for_config(cfg, model_config).best_layout()


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
        except Exception:  # noqa: BLE001 - samples so far are on disk already
            pass
    if parts.replicas is not None:
        try:
            parts.replicas.stop()
        except Exception:  # noqa: BLE001 - keep going: the cluster must stop regardless
            traceback.print_exc()
    if parts.cluster is not None:
        parts.cluster.stop()


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m hpcserve.deployment.driver RUN_DIR")
    sys.exit(run(Path(sys.argv[1]).resolve()))


if __name__ == "__main__":
    main()
