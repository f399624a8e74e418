"""Adopting from the command line (`hpcserve adopt NAME`, or `up` of the config an endpoint runs with):
whether there is anything to adopt, the checks that refuse before anything starts, and the new
controller followed until it has adopted. What the new controller does is control/resume.py."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from hpcserve.core.config import DeploymentConfig, config_differences, load_config
from hpcserve.core.errors import UsageError
from hpcserve.core.files import exclusive, read_secret
from hpcserve.core.net import is_loopback, port_free
from hpcserve.core.osenv import PRIVATE_UMASK, umask
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import Record, list_names, load_record, save_record
from hpcserve.core.runstate import RunState, read_timeline
from hpcserve.core.statuses import RunKind, RunStatus, Stage
from hpcserve.deployment.follow import Event, UpResult, follow
from hpcserve.deployment.runs import is_running, run_of
from hpcserve.endpoint.control.run import EndpointCheck, adopt_endpoint, inspect_endpoint

ADOPT_TIMEOUT_S = 600.0  # a real completion per replica, a router start: seconds; a loaded site: more


def adoptable(name: str) -> bool:
    """A registered endpoint of this name whose controller is gone while its router or replicas run."""
    if name not in list_names():
        return False
    record = load_record(name)
    return record.kind is RunKind.ENDPOINT and not is_running(record) and inspect_endpoint(record).survivors


@umask(PRIVATE_UMASK)  # the new controller's files, like up's
def adopt(name: str, config: str | Path | DeploymentConfig | None = None,
          on_event: Callable[[Event], None] | None = None, timeout_s: float = ADOPT_TIMEOUT_S) -> UpResult:
    """A new controller for endpoint `name` whose controller is gone: it adopts the router (or starts one
    on the same port with the same key) and every member whose job runs and whose replicas answer a real
    completion; lost members are replaced as usual. Every check that can refuse runs before anything
    starts (UsageError, exit 2). With its controller running there is nothing to adopt (idempotent: a
    crontab line can call it). With `config`, it must be the running one."""
    paths = RunPaths(Path(load_record(name).run_dir))
    with exclusive(paths.adopt_lock):
        record = load_record(name)  # again, under the lock: another adopt may have started one meanwhile
        state = RunState.read(record.run_dir)
        if record.kind is RunKind.ENDPOINT and is_running(record):
            return UpResult(name, paths.root, RunStatus.READY, state.replicas, endpoint=state.endpoint_url,
                            reason=f"its controller runs ({run_of(record).runner_line()}): nothing to adopt",
                            adopted=[])
        running = check_adoptable(record, state, inspect_endpoint(record, state))
        if config is not None:
            check_same_config(running, config if isinstance(config, DeploymentConfig) else load_config(config),
                              paths.config)
        check_same_key(running, record.run_dir)
        started, seen = time.time(), len(read_timeline(record.run_dir))  # the predecessor's events: not news
        new = adopt_endpoint(record)
        save_record(new)
    # No cleanup if following fails: the new controller adopting is the repair, and one whose adoption
    # fails leaves what ran as it was (endpoint/control/process.py).
    result = follow(new, on_event, timeout_s, seen_events=seen)
    result.adopted = [d.to_dict() for d in RunState.read(record.run_dir).decisions if d.time >= started]
    return result


def check_adoptable(record: Record, state: RunState, check: EndpointCheck) -> DeploymentConfig:
    """Refuse what cannot be adopted, before anything starts; returns the running config."""
    name = record.name
    if record.kind is not RunKind.ENDPOINT:
        raise UsageError(f"'{name}' has no endpoint (serve.router: false): there is no controller to adopt it; "
                         f"`hpcserve status {name}` tells what runs")
    if not check.survivors:
        raise UsageError(f"nothing of '{name}' runs any more (no router, no member's job): nothing to adopt. "
                         f"`hpcserve down {name}`, then `hpcserve up CONFIG`")
    if not any(e["stage"] == Stage.READY for e in read_timeline(record.run_dir)):
        raise UsageError(f"'{name}' lost its controller before it was ready: nothing served yet, so adopting "
                         f"saves nothing. `hpcserve down {name}`, then `hpcserve up CONFIG`")
    running = load_config(RunPaths(Path(record.run_dir)).config)
    host = "127.0.0.1" if is_loopback(running.serve.host) else running.serve.host
    if not check.router_serving and not port_free(running.serve.port, host):
        raise UsageError(f"the router of '{name}' is gone and port {running.serve.port} is taken by another "
                         "program: a new router cannot start there. Free the port, then adopt again")
    return running


def check_same_config(running: DeploymentConfig, given: DeploymentConfig, copy: Path) -> None:
    """Adopting applies no change: a config that differs would leave members of two shapes behind one
    endpoint, or a router on a port the config no longer names."""
    differences = config_differences(running, given)
    if differences:
        raise UsageError(f"'{running.name}' runs with another config than the one given, and adopting changes "
                         f"nothing that runs. Differences: {'; '.join(differences[:8])}. Adopt it as it runs "
                         f"(`hpcserve adopt {running.name}`; its config: {copy}), or `hpcserve down "
                         f"{running.name}` and `hpcserve up` the new config")


def check_same_key(running: DeploymentConfig, run_dir: str) -> None:
    """The running router and engines check the key in the run folder's key file; a different one in the
    environment would lock clients (and the controller) out."""
    variable = running.serve.api_key_env
    given = os.environ.get(variable or "", "")
    key_file = RunPaths(Path(run_dir)).router_key
    if given and key_file.is_file() and given != read_secret(key_file):
        raise UsageError(f"${variable} holds another key than the one the running endpoint checks: adopting "
                         f"with it would lock clients out. Export the key it was started with, or unset "
                         f"{variable} (the running key is read from the run folder)")
