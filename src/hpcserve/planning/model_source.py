"""What a deployment serves, decided from its config: the model folder (or hub id) vLLM loads, the builtin
tiny model built on first use, the checkpoint's config.json checked against the catalogue, the size of
the weights, and the layout (configured, or planned with `parallelism: auto`). `up` decides it first
(deployment.preflight.prepare); the endpoint's controller and each driver decide it again from the same
config where they run."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpcserve.core.config import BUILTIN_TINY, DeploymentConfig, Layout
from hpcserve.core.errors import ConfigError
from hpcserve.models.tiny import tiny_model_path
from hpcserve.planning.catalog import lookup, resolve_config
from hpcserve.planning.planner import layout_for

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


def model_and_layout(cfg: DeploymentConfig) -> tuple[str, Layout]:
    """The model a deployment's engines load and the layout it runs: configured, or planned for the model
    (`parallelism: auto`)."""
    model_path = resolve_model_path(cfg)
    return model_path, layout_for(cfg, model_config_for(cfg, model_path))


def resolved_layout(cfg: DeploymentConfig) -> Layout:
    return model_and_layout(cfg)[1]


def weight_bytes(model_path: str | None) -> int | None:
    """The size of the weights in a local model folder (None for a hub id or a folder without them)."""
    if not model_path or not Path(model_path).is_dir():
        return None
    total = sum(f.stat().st_size for f in Path(model_path).iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file())
    return total or None
