"""hpcserve's Python API. The CLI is a thin layer over these functions; each is a few lines over the
package that does the work (docs/architecture.md shows the trip `up` makes through them).

    up(config)      start a deployment and follow its stages until it serves, fails, or the caller stops
                    waiting. With serve.router (the default) that is the endpoint controller on this
                    machine, which launches the replicas' drivers (Slurm jobs or local processes);
                    without, the driver itself (local: a detached process; slurm: a batch job)
    down(name)      stop it; nothing stays running on any node
    down_member(name, member)  one member of an endpoint out (its streams continued elsewhere), the rest serving
    adopt(name)     a new controller for an endpoint whose controller is gone: it adopts the router and
                    replicas that still run (`up` of the same config does the same)
    status(name)    what is really running, checked now (process or job, endpoint health)
    log_files(name) the files of its run folder, by node and component
    check(config)   the distributed health check alone
    endpoints(target)  the OpenAI endpoints of a deployment (or a URL), with its key
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from hpcserve.core.config import DeploymentConfig, load_config
from hpcserve.core.errors import ConfigError, HpcserveError, NotFoundError, UsageError
from hpcserve.core.files import read_json
from hpcserve.core.keys import choose_key, read_api_key, remove_secrets
from hpcserve.core.osenv import PRIVATE_UMASK, umask
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import forget, list_names, load_record, save_record
from hpcserve.core.runstate import RunState
from hpcserve.core.statuses import RunKind, RunStatus
from hpcserve.deployment.follow import Event, UpResult, follow
from hpcserve.deployment.logfiles import log_files
from hpcserve.deployment.preflight import check_folders, check_scheduler, prepare
from hpcserve.deployment.runs import CHECK_ONLY_ENV, launch, run_of
from hpcserve.endpoint import (
    MEMBER_DOWN_TIMEOUT_S,
    DeploymentStatus,
    adopt,
    adoptable,
    deployment_status,
    host_endpoint,
    refuse_down_while_joined,
    retire,
    start_endpoint,
    stop_deployment,
)
from hpcserve.engine.client import Endpoint, served_model_names
from hpcserve.monitoring.metrics import Gatherer
from hpcserve.raycluster.nodefiles import remove_run_node_folders
from hpcserve.tenancy import keyring
from hpcserve.tenancy.records import KeyRecord
from hpcserve.tenancy.settings import database_url
from hpcserve.tenancy.store import GroupBy, Store, UsageTotal, open_store

log = logging.getLogger(__name__)


@umask(PRIVATE_UMASK)  # run folders, their files and the registry's records: for their owner alone
def up(config_path: str | Path | DeploymentConfig, on_event: Callable[[Event], None] | None = None,
       timeout_s: float | None = None) -> UpResult:
    """Start the deployment, one trip down the layers: the config, the checks and the plan (nothing started
    when they refuse), the launch (the endpoint's controller, or the driver alone), then its stages followed
    until it serves. An endpoint of this name whose controller is gone while its router or replicas run
    is adopted instead (no running replica restarted), if the config is the running one."""
    cfg = config_path if isinstance(config_path, DeploymentConfig) else load_config(config_path)
    if adoptable(cfg.name):
        return adopt(cfg.name, cfg, on_event)
    source = cfg.name if isinstance(config_path, DeploymentConfig) else str(config_path)
    swap_problem = swap_refusal(cfg)
    if swap_problem:
        raise ConfigError(f"{source}: {swap_problem}")
    prepared = prepare(cfg, source)
    results = Path(cfg.results_dir).resolve()
    # A model that joins another endpoint takes its key: the data plane passes clients' keys to the engines.
    key = (host_endpoint(cfg).key() if cfg.serve.join
           else choose_key(cfg.serve.api_key_env, cfg.serve.insecure_no_api_key))  # every deployment has one
    started = time.monotonic()
    record = (start_endpoint(cfg, prepared, results, key, source) if cfg.serve.router
              else launch(cfg, results, key))
    save_record(record)
    try:
        result = follow(record, on_event, timeout_s or cfg.engine.startup_timeout_s + 600)
    except BaseException:  # a deadline, Ctrl-C: nothing half-started stays behind
        try:
            stop_deployment(record)
        except HpcserveError as cleanup:  # report it, but the original failure is the news
            log.error("while stopping after the failure: %s", cleanup)
        raise
    result.seconds = time.monotonic() - started
    if result.status is not RunStatus.READY:
        stop_deployment(record)
    return result


def swap_refusal(cfg: DeploymentConfig) -> str | None:
    """Why `up` cannot run this config's swap (None: no swap, or it can). Not in the schema: a member's config
    keeps swap (its models' engines) without a router of its own."""
    if cfg.swap is not None and not cfg.serve.router:
        return "swap puts models to sleep and wakes them by demand at the endpoint: it needs serve.router true"
    return None


@umask(PRIVATE_UMASK)
def check(config_path: str | Path, on_event: Callable[[Event], None] | None = None) -> tuple[Path, dict | None]:
    """The distributed health check alone: Ray over the nodes, the check, everything stopped again."""
    cfg = load_config(config_path)
    check_scheduler(cfg)
    check_folders(cfg)
    results = Path(cfg.results_dir).resolve()
    key = choose_key(cfg.serve.api_key_env, cfg.serve.insecure_no_api_key)  # unused by a check: removed with it
    record = launch(cfg.model_copy(update={"name": f"{cfg.name}-check"}), results, key, {CHECK_ONLY_ENV: "1"})
    try:
        result = follow(record, on_event, timeout_s=600)
    finally:
        run_of(record).stop(grace_s=60)  # the driver stops Ray itself after the check; cancel only if it hangs
        remove_secrets(record.run_dir)
        remove_run_node_folders(record.run_dir)  # what a node killed before its clean-up left in /tmp
    return result.run_dir, read_json(RunPaths(result.run_dir).health)


def down(name: str, timeout_s: float = 90.0) -> dict:
    record = load_record(name)
    if record.kind is RunKind.ENDPOINT:
        refuse_down_while_joined(record)  # other deployments' models in its data plane: theirs to take out first
        timeout_s += 90.0  # it stops its members (each up to a minute, in parallel), then the router
    left = stop_deployment(record, timeout_s)
    forget(name)
    return {"name": name, "run_dir": record.run_dir, "left_running": left}


def down_member(name: str, member: str, timeout_s: float = MEMBER_DOWN_TIMEOUT_S) -> dict:
    record = load_record(name)
    if record.kind is not RunKind.ENDPOINT:
        raise UsageError(f"{name} is a single deployment, not an endpoint with members: `hpcserve down {name}` stops it")
    status = retire(Path(record.run_dir), member, timeout_s)
    return {"name": name, "member": member, "status": str(status) if status else None, "run_dir": record.run_dir}


def status(name: str | None = None) -> list[DeploymentStatus]:
    return [deployment_status(load_record(n)) for n in ([name] if name else list_names())]


# ------------------------------------------------------------------ clients

def api_key_for(name: str) -> str | None:
    """The key clients send to this deployment (from the generated file or the environment variable)."""
    return read_api_key(load_record(name).run_dir)


def gatherer(name: str, max_age_s: float = 1.0) -> Gatherer:
    """Live metrics of one deployment (replicas' /metrics, nodes' samples) for the dashboard and --watch."""
    return Gatherer(name, status_fn=lambda n: status(n)[0], key_fn=_key_or_none, max_age_s=max_age_s)


def _key_or_none(name: str) -> str | None:
    try:
        return api_key_for(name)
    except (HpcserveError, OSError):
        return None


def endpoints(target: str, api_key: str | None = None) -> list[Endpoint]:
    """A deployment name gives its endpoint (the router, when ready) or its replicas; a URL gives itself."""
    if target.startswith(("http://", "https://")):
        return [Endpoint(target.rstrip("/").removesuffix("/v1"), None, api_key)]
    record = load_record(target)
    state = RunState.read(record.run_dir)
    key = api_key or read_api_key(record.run_dir)
    model = state.replicas[0].get("model") if state.replicas else None
    if state.endpoint_url and state.status is RunStatus.READY:  # one URL in front of every replica
        return [Endpoint(state.endpoint_url, model, key)]
    if not state.replicas:
        raise NotFoundError(f"deployment '{target}' has no endpoint yet (stage: {state.stage or 'unknown'}); "
                            f"see `hpcserve status {target}`")
    return [Endpoint(r["url"], r.get("model"), key) for r in state.replicas]


# ------------------------------------------------------------------ tenants

def tenancy_store(target: str | Path) -> Store:
    """The store of a deployment's keys and usage: by its name (a deployment `up` started, running or not
    since) or its config file. The caller closes it."""
    return open_store(tenancy_database(target))


def tenancy_database(target: str | Path) -> str:
    path = Path(target)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        cfg = load_config(path)
        return database_url(cfg, Path(cfg.results_dir).resolve())
    record = load_record(str(target))
    run_dir = Path(record.run_dir)
    return database_url(load_config(RunPaths(run_dir).config), run_dir.parent.parent)  # RESULTS/logs/RUN


def add_key(target: str | Path, user: str, **options) -> tuple[str, KeyRecord]:
    """A new key for user (keyring.add_key's options): the whole key, shown once, and its record."""
    store = tenancy_store(target)
    try:
        return keyring.add_key(store, user, **options)
    finally:
        store.close()


def served_models(target: str | Path) -> list[str] | None:
    """The models a running deployment's endpoint serves now (its GET /v1/models), or None where that is not
    known: a config file, a deployment not ready, an endpoint not answering."""
    try:
        endpoint, = endpoints(str(target))  # one URL in front of every replica, or a deployment's one replica
    except (HpcserveError, OSError, ValueError):
        return None
    return served_model_names(endpoint)


def keys(target: str | Path) -> list[KeyRecord]:
    store = tenancy_store(target)
    try:
        return store.keys()
    finally:
        store.close()


def revoke_key(target: str | Path, selector: str) -> list[KeyRecord]:
    """Revoke a key by its id, or every live key of a user; refused on every data-plane worker within 1 s."""
    store = tenancy_store(target)
    try:
        return keyring.revoke(store, selector)
    finally:
        store.close()


def usage(target: str | Path, by: GroupBy = GroupBy.USER, since: float | None = None,
          until: float | None = None) -> list[UsageTotal]:
    store = tenancy_store(target)
    try:
        return store.usage(by, since, until)
    finally:
        store.close()


# The library's surface: what the CLI, the workflows and users' scripts import from here.
__all__ = ["DeploymentStatus", "Event", "HpcserveError", "RunStatus", "UpResult", "add_key", "adopt",
           "api_key_for", "check", "down", "endpoints", "gatherer", "keys", "load_config", "load_record",
           "log_files", "revoke_key", "status", "tenancy_store", "up", "usage"]
