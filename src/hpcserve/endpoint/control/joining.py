"""Several deployments behind one URL: a deployment with serve.join puts its model into another running
endpoint's data plane instead of opening a port of its own.

    host = host_endpoint(cfg)            # the endpoint it joins, checked (ConfigError, nothing started)
    router = joined_router(cfg, paths, key_file)   # its controller's Router: its model's room only
    joined_deployments(record)           # who joined this endpoint (its `down` refuses while any run)
    leave(cfg, model)                    # its model out of the host's data plane (what `down` does after
                                         # a killed controller)

Why a room in the host's data plane and not a proxy in front of it: a second hop would cost every request
what the router has won, and the models would not share the port, the key and the tenants' view. The host
owns the data plane (its port, key, tenants, process): a joined deployment only ever adds, changes and
removes its own model's room. The host's `down` is refused while models of others are in it (their
clients would be cut, and a data plane without its owner would have nobody to restart or adopt it); the
last word is the user's: `down` the joined ones first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import httpx

from hpcserve.core.config import DeploymentConfig, load_config
from hpcserve.core.errors import ConfigError, HpcserveError, NotFoundError, UsageError
from hpcserve.core.keys import ApiKey, handed_on, read_api_key
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import Record, list_names, load_record
from hpcserve.core.runstate import RunState
from hpcserve.core.statuses import RunKind
from hpcserve.endpoint.control.plane_client import (
    Host,
    Router,
    RouterError,
    router_serving,
)
from hpcserve.endpoint.protocol import Models, ModelSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostEndpoint:
    """The running endpoint a deployment joins: its record, config and run folder's paths."""

    record: Record
    cfg: DeploymentConfig
    paths: RunPaths

    def router_pid(self) -> int | None:
        """The host's data plane PID now (its controller writes a new one when it restarts it)."""
        return RunState.read(self.record.run_dir).router_pid

    def models(self) -> Models:
        """The models in the host's data plane now (RouterError when it does not answer)."""
        router = Router(self.cfg.serve.host, self.cfg.serve.port, None, self.paths.router_log,
                        admin_socket=self.paths.router_admin)
        try:
            return router.models()
        finally:
            router.close()

    def key(self) -> ApiKey:
        """The key the host's clients send: the joined model's engines must accept it (the data plane passes
        clients' keys on)."""
        return handed_on(self.record.run_dir, read_api_key(self.record.run_dir))


def join_name(cfg: DeploymentConfig) -> str:
    """The deployment cfg joins (callers ask only for a config with serve.join)."""
    if cfg.serve.join is None:
        raise ConfigError(f"{cfg.name} joins no endpoint (serve.join is not set)")
    return cfg.serve.join


def host_endpoint(cfg: DeploymentConfig) -> HostEndpoint:
    """The endpoint cfg joins, checked now: it exists, is an endpoint of its own (not itself joined), its
    data plane serves, and no model of cfg's served name is there. ConfigError naming the fix otherwise."""
    name = join_name(cfg)
    try:
        record = load_record(name)
    except NotFoundError:
        known = ", ".join(list_names()) or "none"
        raise ConfigError(f"serve.join '{name}': no deployment of yours by that name (yours: {known}); start "
                          "that endpoint first with `hpcserve up`, or fix the name") from None
    if record.kind is not RunKind.ENDPOINT:
        raise ConfigError(f"serve.join '{name}': that deployment has no endpoint (serve.router false); join one "
                          "that runs with serve.router true")
    paths = RunPaths(Path(record.run_dir))
    host_cfg = load_config(paths.config)
    if host_cfg.serve.join:
        raise ConfigError(f"serve.join '{name}': that deployment joined '{host_cfg.serve.join}' itself; join "
                          f"'{host_cfg.serve.join}'")
    host = HostEndpoint(record, host_cfg, paths)
    state = RunState.read(record.run_dir)
    if not (state.endpoint_url and router_serving(state.router_pid, state.endpoint_url)):
        raise ConfigError(f"serve.join '{name}': its endpoint does not serve now (`hpcserve status {name}`); "
                          "start or adopt it first")
    try:
        models = host.models()
    except (RouterError, httpx.HTTPError, ValueError) as exc:
        raise ConfigError(f"serve.join '{name}': its data plane did not list its models: {exc}") from None
    if cfg.model.name in models.names():
        raise ConfigError(f"serve.join '{name}': a model named '{cfg.model.name}' is served there already "
                          f"(models: {', '.join(models.names())}); give this one another name (model.served_name)")
    return host


def joined_router(cfg: DeploymentConfig, paths: RunPaths, key_file: Path | None,
                  tokenizer: tuple[str | None, str | None] = (None, None)) -> Router:
    """The controller's Router for a joined deployment: the host's port and admin socket, its model's room.
    tokenizer: the model folder and chat template its prompts are read with (prefix routing by KV events)."""
    record = load_record(join_name(cfg))
    host_paths = RunPaths(Path(record.run_dir))
    host_cfg = load_config(host_paths.config)
    folder, template = tokenizer
    spec = ModelSpec(cfg.model.name, str(cfg.serve.routing), cfg.serve.hold_s, folder, template)
    host = HostEndpoint(record, host_cfg, host_paths)
    return Router(host_cfg.serve.host, host_cfg.serve.port, key_file, paths.router_log, model=cfg.model.name,
                  policy=cfg.serve.routing, admin_socket=host_paths.router_admin, hold_s=cfg.serve.hold_s,
                  joined=Host(spec, host.router_pid))


def dataplane_of(record: Record) -> tuple[Path, str | None]:
    """The admin socket of the data plane that serves this endpoint's model, and the model to ask about
    there (None: the data plane's own): a joined deployment's is its host's."""
    paths = RunPaths(Path(record.run_dir))
    try:
        cfg = load_config(paths.config)
        if cfg.serve.join:
            return RunPaths(Path(load_record(cfg.serve.join).run_dir)).router_admin, cfg.model.name
    except (HpcserveError, OSError):
        pass
    return paths.router_admin, None


def joined_deployments(record: Record) -> list[str]:
    """Models of other deployments in this endpoint's data plane now, by their deployments' names where the
    registry knows them ("model (deployment)"). Empty when its data plane does not answer."""
    paths = RunPaths(Path(record.run_dir))
    state = RunState.read(record.run_dir)
    if not (state.endpoint_url and router_serving(state.router_pid, state.endpoint_url)):
        return []
    try:
        cfg = load_config(paths.config)
        models = HostEndpoint(record, cfg, paths).models()
    except (HpcserveError, httpx.HTTPError, ValueError):
        return []
    owners = {}
    for name in list_names():
        try:
            other = load_config(RunPaths(Path(load_record(name).run_dir)).config)
        except (HpcserveError, OSError):
            continue
        if other.serve.join == record.name:
            owners[other.model.name] = name
    own = {spec.name for spec in cfg.swap.models} if cfg.swap else set()  # its swap models' rooms are its own
    return [f"{model} ({owners[model]})" if model in owners else model for model in models.joined() if model not in own]


def refuse_down_while_joined(record: Record) -> None:
    """UsageError while other deployments' models are in this endpoint: its down would cut their clients.
    (A joined deployment's own down takes only its model out: never refused.)"""
    if dataplane_of(record)[1] is not None:
        return
    joined = joined_deployments(record)
    if joined:
        raise UsageError(f"{record.name} serves the models of deployments that joined it: {', '.join(joined)}. "
                         "`hpcserve down` those first; stopping this endpoint now would cut their clients")


def leave(cfg: DeploymentConfig, model: str) -> None:
    """The model out of the host's data plane, when its controller could not do it (killed); nothing when
    the host is gone."""
    try:
        record = load_record(join_name(cfg))
    except NotFoundError:
        return
    host_paths = RunPaths(Path(record.run_dir))
    router = joined_router(cfg, host_paths, None)
    router.pid = RunState.read(record.run_dir).router_pid
    try:
        router.leave()
    finally:
        router.close()
