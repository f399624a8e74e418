"""Starting, adopting, checking and stopping an endpoint from outside (what `up`, `adopt`, `status` and
`down` call). Its controller is a detached process here; the router and the members' jobs outlive it.

    start_endpoint(cfg, prepared, results, key)
                                   the walltime handover's room checked, then a new run folder and its
                                   controller
    adopt_endpoint(record)         a new controller in the same run folder: it adopts what still runs
    inspect_endpoint(record)       the controller, the router and every member, each checked now (not
                                   what the controller last wrote: it may be gone)
    stop_endpoint(record)          the controller stops the rest itself; what it left (it was killed)
                                   is stopped from here, by the PIDs and jobs its state recorded
    stop_deployment(record)        any deployment, an endpoint or a driver alone: stopped, its secrets and
                                   its nodes' temporary folders removed
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

from hpcserve.core.config import DeploymentConfig, load_config
from hpcserve.core.keys import ApiKey, remove_secrets
from hpcserve.core.net import remove_unix_socket
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import Record
from hpcserve.core.runstate import RunState
from hpcserve.core.statuses import MemberStatus, RunKind
from hpcserve.deployment.preflight import Prepared, check_walltime
from hpcserve.deployment.runs import LocalRun, run_of
from hpcserve.endpoint.control.joining import leave
from hpcserve.endpoint.control.members import Member
from hpcserve.endpoint.control.plane_client import is_router, router_serving, stop_router
from hpcserve.endpoint.control.policies.handover import handover_room
from hpcserve.engine.client import health_ok
from hpcserve.raycluster.nodefiles import remove_run_node_folders

CONTROLLER_MODULE = "hpcserve.endpoint.control.process"
# Members whose job may still hold a replica (a stopping one's job may not have ended yet).
CHECKED = (MemberStatus.LAUNCHING, MemberStatus.SERVING, MemberStatus.DRAINING, MemberStatus.STOPPING,
           MemberStatus.SLEEPING)


def start_endpoint(cfg: DeploymentConfig, prepared: Prepared, results: Path, key: ApiKey, source: str) -> Record:
    """Refuse a walltime too short for the handover (ConfigError, nothing started), then start the
    controller. source: where the config came from, for that message."""
    check_walltime(handover_room(cfg, prepared.model_path, prepared.layout), source)
    return LocalRun.start(cfg, results, CONTROLLER_MODULE, RunKind.ENDPOINT, key, {}).record


def adopt_endpoint(record: Record) -> Record:
    """A new controller in the endpoint's run folder (its state lists members: the controller adopts them,
    never starts afresh); the returned record names it."""
    return LocalRun.restart(record, CONTROLLER_MODULE, {}).record


@dataclass(frozen=True)
class MemberCheck:
    member: Member
    gone: str | None  # why its job or driver no longer serves, checked now; None while it runs
    runner: str  # its job's state as Slurm tells it now, or its driver's PID
    answering: tuple[str, ...]  # its replicas that answer /health now


@dataclass(frozen=True)
class EndpointCheck:
    controller_gone: str | None  # why the controller no longer runs; None while it does
    router_pid: int | None
    router_serving: bool  # that PID is our router on the endpoint's port, and it answers
    members: tuple[MemberCheck, ...]

    @property
    def running_members(self) -> list[MemberCheck]:
        return [m for m in self.members if m.gone is None]

    @property
    def survivors(self) -> bool:
        """Something of the endpoint still runs without its controller: worth adopting, not restarting."""
        return self.router_serving or bool(self.running_members)


def inspect_endpoint(record: Record, state: RunState | None = None) -> EndpointCheck:
    state = state or RunState.read(record.run_dir)
    members = [Member.from_json(m) for m in state.members]
    url = state.endpoint_url
    serving = router_serving(state.router_pid, url) if url else False
    return EndpointCheck(LocalRun(record).gone(), state.router_pid, serving,
                         tuple(check_member(m) for m in members if m.status in CHECKED))


def check_member(member: Member) -> MemberCheck:
    run = run_of(member.as_record())
    gone = run.gone()
    answering = () if gone else tuple(url for url in member.backends if health_ok(url))
    return MemberCheck(member, gone, gone or run.runner_line(), answering)


def stop_endpoint(record: Record, timeout_s: float) -> list[int]:
    """The controller stops its members and the router itself; whatever it left (it was killed) is stopped
    here. Returns PIDs still alive on this machine afterwards, which should be none."""
    left = LocalRun(record).stop(timeout_s)
    state = RunState.read(record.run_dir)
    router_left = False
    cfg = load_config(RunPaths(Path(record.run_dir)).config)
    if cfg.serve.join:  # the data plane is the host's: only our model leaves it
        leave(cfg, cfg.model.name)
    elif state.router_pid and state.endpoint_url:  # only if that PID is still our router on our port
        port = httpx.URL(state.endpoint_url).port
        stop_router(state.router_pid, port=port)
        router_left = is_router(state.router_pid, port)
    for member in state.members:
        run = run_of(Record.from_dict(member["record"]))
        if run.gone() is None:
            left += run.stop(timeout_s)
    if not router_left and not left:
        remove_admin_socket(RunPaths(Path(record.run_dir)))
    return left


def remove_admin_socket(paths: RunPaths) -> None:
    """The stopped data plane's admin socket, when it lay outside the run folder (/tmp/hpcserve-UID/ for a
    run folder too deep for a socket path): `down` leaves nothing of the deployment outside its results
    folder. The folder is shared by the user's deployments: it goes only when none has a socket there."""
    socket = paths.router_admin
    if paths.root not in socket.parents:
        remove_unix_socket(socket)


def stop_deployment(record: Record, timeout_s: float = 90.0) -> list[int]:
    """Stop a deployment (an endpoint with its members, or a driver alone); returns PIDs still alive
    afterwards (on this machine), which should be none."""
    try:
        if record.kind is RunKind.ENDPOINT:
            return stop_endpoint(record, timeout_s)
        return run_of(record).stop(timeout_s)
    finally:
        remove_secrets(record.run_dir)  # a stopped deployment keeps no copy of its key or Ray's token
        remove_run_node_folders(record.run_dir)  # what its nodes left in /tmp, killed members' too
