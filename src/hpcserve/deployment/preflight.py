"""Checks before anything starts: a deployment of the same name running, a bad model path, a busy port, a
layout the model cannot take or a walltime too short for the walltime handover is reported as a
ConfigError or UsageError (exit code 2) with nothing started.

    prepare(cfg, source)   every check `up` runs before it starts anything, in order; returns what it
                           found (the model and the configured layout)
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from hpcserve.core.config import DeploymentConfig, Layout
from hpcserve.core.errors import ConfigError, UsageError
from hpcserve.core.folders import check_not_shared
from hpcserve.core.net import is_loopback, port_free
from hpcserve.core.registry import check_home, list_names, load_record
from hpcserve.deployment.runs import is_running
from hpcserve.planning.model_source import check_weights_here, model_config_for, resolve_model_path, weight_bytes
from hpcserve.planning.planner import check_config_layout
from hpcserve.planning.walltime import WalltimeCheck, startup_before_measurement
from hpcserve.slurm.parse import WillRun, slurm_epoch, time_limit_seconds


@dataclass(frozen=True)
class Prepared:
    """What the checks found: the folder (or hub id) vLLM loads and the configured layout (None with
    `parallelism: auto`: planned where the replicas are launched)."""

    model_path: str
    layout: Layout | None


def prepare(cfg: DeploymentConfig, source: str) -> Prepared:
    """Every check before `up` starts anything; source: where the config came from, for messages."""
    if cfg.name in list_names() and is_running(load_record(cfg.name)):
        raise UsageError(f"a deployment named '{cfg.name}' is already running: `hpcserve down {cfg.name}` "
                         "first, or change 'name' in the config")
    check_scheduler(cfg)
    check_folders(cfg)  # nobody else can plant files where the run's processes read them
    model_path = resolve_model_path(cfg)
    check_weights_here(cfg, model_path)  # local scheduler: the weights must be here to serve
    model_config = model_config_for(cfg, model_path)
    layout = cfg.parallelism if isinstance(cfg.parallelism, Layout) else None
    if layout and model_config:
        problems = check_config_layout(cfg, model_config, layout)
        if problems:
            raise ConfigError(f"{source}: parallelism {layout.tensor}x{layout.pipeline}x{layout.replicas} "
                              f"(tensor x pipeline x replicas) cannot serve this model: {'; '.join(problems)}. "
                              "Run `hpcserve plan CONFIG` for a layout that fits")
    check_port(cfg, (layout.replicas if layout else 1) + (1 if cfg.serve.router else 0))
    return Prepared(model_path, layout)


RESULTS_FIX = ("Set results_dir to a folder only you can write (under your home, or $SCRATCH/$USER), or remove "
               "the others' write permission (chmod go-w FOLDER)")


def check_folders(cfg: DeploymentConfig) -> None:
    """results_dir and HPCSERVE_HOME: nobody else may write into them (UnsafePathError, exit code 2)."""
    check_not_shared(Path(cfg.results_dir), "results_dir", RESULTS_FIX)
    check_home()


def check_port(cfg: DeploymentConfig, replicas: int) -> None:
    if cfg.cluster.scheduler != "local":
        return  # ports on compute nodes are checked there
    host = "127.0.0.1" if is_loopback(cfg.serve.host) else cfg.serve.host
    for port in range(cfg.serve.port, cfg.serve.port + replicas):
        if not port_free(port, host):
            raise ConfigError(f"'serve.port' = {cfg.serve.port}: port {port} is already in use on this machine. "
                              "Choose a free port, or stop what uses it (`hpcserve status` lists deployments)")


def check_scheduler(cfg: DeploymentConfig) -> None:
    if cfg.cluster.scheduler == "slurm" and not shutil.which("sbatch"):
        raise ConfigError("'cluster.scheduler' = 'slurm' but sbatch is not on PATH: run on a login node, "
                          "load the Slurm module, or use `hpcserve sandbox up` to try a local Slurm cluster")


def walltime_check(cfg: DeploymentConfig, model_path: str, will_run: WillRun | None, now: float,
                   measured: tuple[float, str] | None = None) -> WalltimeCheck | None:
    """The walltime handover's room (planning.walltime) for an endpoint on Slurm with a time limit, else None.
    measured: (startup, where it was measured), e.g. the last run's members; else serve.startup_s or
    estimated from the weights.
    will_run: Slurm's answer to `sbatch --test-only` for one member (its queue wait now)."""
    walltime = time_limit_seconds(cfg.cluster.time)
    if cfg.cluster.scheduler != "slurm" or not cfg.serve.router or walltime is None:
        return None
    measured = measured or startup_before_measurement(weight_bytes(model_path), cfg.serve.startup_s)
    start = slurm_epoch(will_run.start) if will_run else None
    queue = max(0.0, start - now) if start is not None else 0.0
    return WalltimeCheck(walltime, measured[0], queue, measured[1],
                         f"Slurm expects a member's job to start at {will_run.start}" if will_run else "no estimate")


def check_walltime(check: WalltimeCheck | None, config_path: str) -> None:
    """Refuse a walltime that leaves a job less than a quarter of its time to serve (one message, exit 2)."""
    problem = check.problem("cluster.time") if check else None
    if problem:
        raise ConfigError(f"{config_path}: {problem}")

