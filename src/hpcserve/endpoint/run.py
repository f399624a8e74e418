"""Starting and stopping an endpoint from outside (what `up` and `down` call): its controller is a
detached process here; when that process died before it could stop what it started, the router and the
members are stopped from here, by the PIDs and jobs its state recorded."""

from __future__ import annotations

from pathlib import Path

from hpcserve.core.config import DeploymentConfig
from hpcserve.core.keys import ApiKey
from hpcserve.core.registry import Record
from hpcserve.core.runstate import RunState
from hpcserve.core.statuses import RunKind
from hpcserve.deployment.runs import LocalRun, run_of
from hpcserve.endpoint.router import stop_router

CONTROLLER_MODULE = "hpcserve.endpoint.process"


def start_endpoint(cfg: DeploymentConfig, results: Path, key: ApiKey) -> Record:
    return LocalRun.start(cfg, results, CONTROLLER_MODULE, RunKind.ENDPOINT, key, {}).record


def stop_endpoint(record: Record, timeout_s: float) -> list[int]:
    """The controller stops its members and the router itself; whatever it left (it was killed) is stopped
    here. Returns PIDs still alive on this machine afterwards, which should be none."""
    left = LocalRun(record).stop(timeout_s)
    state = RunState.read(record.run_dir)
    if state.router_pid:
        stop_router(state.router_pid)  # checks that the PID is still our router
    for member in state.members:
        run = run_of(Record.from_dict(member["record"]))
        if run.gone() is None:
            left += run.stop(timeout_s)
    return left
