"""Checks before anything starts: a bad model path, a busy port, a layout the model cannot take or a
walltime too short for the walltime handover is reported as a ConfigError (exit code 2) with nothing
started."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hpcserve.core.config import BUILTIN_TINY, DeploymentConfig, Layout
from hpcserve.core.errors import ConfigError
from hpcserve.core.folders import check_not_shared
from hpcserve.core.net import is_loopback, port_free
from hpcserve.core.registry import check_home
from hpcserve.models.tiny import tiny_model_path
from hpcserve.planning.catalog import lookup, resolve_config
from hpcserve.planning.planner import layout_for
from hpcserve.planning.walltime import WalltimeCheck, startup_before_measurement
from hpcserve.slurm.parse import WillRun, slurm_epoch, time_limit_seconds

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", ".", "~")) or os.path.exists(spec)


def resolve_model_path(cfg: DeploymentConfig) -> str:
    """The folder (or hub id) vLLM loads. The builtin tiny model is built here on first use. With
    model.catalog the folder may be missing here or lack config.json (weights staged later, or only on the
    compute nodes): the catalogue gives the planner the shape, so only a well-formed path is required."""
    spec = cfg.model.path
    if spec == BUILTIN_TINY:

        return str(tiny_model_path())
    if spec.startswith("builtin:"):
        raise ConfigError(f"'model.path' = {spec!r}: unknown builtin model; the only one is {BUILTIN_TINY}")
    if looks_like_path(spec):
        path = Path(spec).expanduser()
        if cfg.model.catalog and not (path / "config.json").is_file():

            lookup(cfg.model.catalog)  # an unknown name is the error to report, not the missing folder
            return str(path.absolute())
        if not path.is_dir():
            raise ConfigError(f"'model.path' = {spec!r}: no such folder. Point it at a local model folder "
                              f"(with config.json), a hub id like org/name, or {BUILTIN_TINY}")
        if not (path / "config.json").is_file():
            raise ConfigError(f"'model.path' = {spec!r}: the folder has no config.json; is it a Hugging Face model folder?")
        return str(path.resolve())
    return spec  # a hub id: vLLM resolves it on the cluster


def read_model_config(model_path: str) -> dict | None:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); the model folder is damaged") from None


def model_config_for(cfg: DeploymentConfig, model_path: str) -> dict | None:
    """The config.json the planner reads for this deployment: the checkpoint's (checked against model.catalog
    when both exist: one ConfigError listing what differs), else the catalogue's, else None."""
    return resolve_config(cfg.model.catalog, read_model_config(model_path), cfg.model.quantization)


def check_weights_here(cfg: DeploymentConfig, model_path: str) -> None:
    """With cluster.scheduler 'local' vLLM loads model.path on this machine: a catalogue name plans without
    the weights, but serving needs them."""
    if cfg.cluster.scheduler == "local" and looks_like_path(model_path) and not (Path(model_path) / "config.json").is_file():
        raise ConfigError(f"'model.path' = {cfg.model.path!r}: no model folder with config.json here, and "
                          "cluster.scheduler 'local' serves from this machine. Stage the weights there first "
                          "(model.catalog lets `hpcserve plan` run without them)")


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



def resolved_layout(cfg: DeploymentConfig) -> Layout:
    """The layout this deployment runs: configured, or planned for the model (`parallelism: auto`)."""
    return layout_for(cfg, model_config_for(cfg, resolve_model_path(cfg)))


def weight_bytes(model_path: str | None) -> int | None:
    """The size of the weights in a local model folder (None for a hub id or a folder without them)."""
    if not model_path or not Path(model_path).is_dir():
        return None
    total = sum(f.stat().st_size for f in Path(model_path).iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file())
    return total or None


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

