"""What `hpcserve status` tells of a deployment: what its process last wrote, corrected by what is alive
now (its process or job, each replica's /health, whether the data plane holds requests); for an endpoint
whose controller is gone, each part checked now, with the command that brings control back."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import Record
from hpcserve.core.runstate import RunState, read_timeline
from hpcserve.core.statuses import MemberStatus, RunKind, RunStatus
from hpcserve.core.timeline import stage_breakdown
from hpcserve.deployment.runs import run_of
from hpcserve.endpoint.control.holding import holding, read_backends
from hpcserve.endpoint.control.members import Member
from hpcserve.endpoint.control.run import EndpointCheck, MemberCheck, inspect_endpoint
from hpcserve.engine.client import health_ok


@dataclass
class DeploymentStatus:
    name: str
    scheduler: str
    status: RunStatus  # what the driver last wrote, corrected by what is alive now
    stage: str | None
    runner: str  # the driver process or the Slurm job, checked now
    run_dir: str
    replicas: list[dict]
    error: dict | None
    job_id: str | None = None
    stages: dict = field(default_factory=dict)  # where up's time went: timeline.stage_breakdown
    endpoint: str | None = None  # the router's URL (serve.router)
    members: list[dict] = field(default_factory=list)  # the deployments behind the router, one line each
    decisions: list[dict] = field(default_factory=list)  # the endpoint's last decisions, with reasons
    advice: str | None = None  # what to run to put it right (an endpoint without its controller)
    holding: dict | None = None  # no replica takes requests: held now, since when, the members waited for
    admission_waiting: int = 0  # requests waiting now for room in the replicas' KV caches (endpoint/dataplane/admission.py)

    def to_json(self) -> dict:
        """Plain JSON values (statuses and paths as text): what `hpcserve status --json` prints."""
        return json.loads(json.dumps(self.__dict__, default=str))


def deployment_status(record: Record) -> DeploymentStatus:
    state = RunState.read(record.run_dir)
    run = run_of(record)
    gone = run.gone()
    if gone and record.kind is RunKind.ENDPOINT:
        check = inspect_endpoint(record, state)
        if check.survivors:
            return uncontrolled_status(record, state, check)
    current = state.status
    if gone and not current.ended:
        current = RunStatus.DEAD  # the file says otherwise, but nothing is running: say so
    replicas = [{**rep, "healthy": (not gone) and health_ok(rep["url"])} for rep in state.replicas]
    if current is RunStatus.READY and replicas and not all(r["healthy"] for r in replicas):
        current = RunStatus.DEGRADED
    stages = stage_breakdown(read_timeline(record.run_dir), record.created, state.job_started)
    members = [member_line(Member.from_json(m)) for m in state.members]
    decisions = [d.to_dict() for d in state.decisions]
    # What clients get, asked of the data plane: the controller's file says ready while a late successor
    # leaves the pool empty (endpoint/control/holding.py), and requests may wait for room in the KV caches
    answer = (read_backends(RunPaths(Path(record.run_dir)).router_admin)
              if record.kind is RunKind.ENDPOINT and current in (RunStatus.READY, RunStatus.DEGRADED) else None)
    hold = holding(answer, members, decisions) if answer else None
    return DeploymentStatus(record.name, record.scheduler, RunStatus.HOLDING if hold else current, state.stage,
                            gone or run.runner_line(), record.run_dir, replicas,
                            state.error.to_dict() if state.error else None, record.job_id, stages,
                            state.endpoint_url, members, decisions, holding=hold,
                            admission_waiting=int(answer.get("waiting") or 0) if answer else 0)


def uncontrolled_status(record: Record, state: RunState, check: EndpointCheck) -> DeploymentStatus:
    """An endpoint whose controller is gone while its router or replicas run: what the controller last
    wrote no longer holds, so each part is shown as checked now (the router's PID and port, each member's
    job and replicas), with the command that brings control back."""
    answering = {url for m in check.members for url in m.answering}
    router = (f"router pid {check.router_pid} serving on {state.endpoint_url}" if check.router_serving
              else f"router gone (pid {check.router_pid}): nothing answers on {state.endpoint_url}")
    checked = {m.member.name: m for m in check.members}
    return DeploymentStatus(
        record.name, record.scheduler, RunStatus.UNCONTROLLED, state.stage,
        f"controller pid {record.driver_pid} gone (see endpoint.log); {router}",
        record.run_dir, [{**rep, "healthy": rep["url"] in answering} for rep in state.replicas],
        state.error.to_dict() if state.error else None, record.job_id,
        stage_breakdown(read_timeline(record.run_dir), record.created, state.job_started), state.endpoint_url,
        [member_line(Member.from_json(m), checked.get(m["name"])) for m in state.members],
        [d.to_dict() for d in state.decisions],
        advice=f"nothing probes, replaces or scales it now: `hpcserve adopt {record.name}` brings control back "
               "(no running replica restarts)")


def member_line(member: Member, checked: MemberCheck | None = None) -> dict:
    """What status shows of a member: name, role, state, where it runs, its replicas. checked: its job and
    replicas as they are now (the controller that wrote its state is gone)."""
    record = member.as_record()
    line = {"name": member.name, "role": member.role, "status": member.status, "group": member.group,
            "runner": f"job {record.job_id}" if record.job_id else f"pid {record.driver_pid}",
            "backends": member.backends, "ready_s": member.ready_s, "note": member.note,
            "run_dir": record.run_dir, "error": member.error}
    if checked is not None:
        status = MemberStatus.GONE if checked.gone else member.status
        answer = f"{len(checked.answering)}/{len(member.backends)} replica(s) answer now" if member.backends else ""
        line.update(status=status, runner=checked.runner, note=answer if not checked.gone else "")
    return line
