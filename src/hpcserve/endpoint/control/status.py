"""What `hpcserve status` tells of a deployment: what its process last wrote, corrected by what is alive
now (its process or job, each replica's /health, whether the data plane holds requests); for an endpoint
whose controller is gone, each part checked now, with the command that brings control back.

Lost replicas count (count_replicas, pure): a member that served and then left without being drained on
purpose (its node died, its engine crashed, its job ended) counts as a replica not up, "degraded: 2/3 up
(... lost at ..., replaced by ...)", also once its replacement serves, until the user acknowledges it
(`hpcserve status NAME --ack`) and a replacement serves in its place, or a walltime handover renewed that
replica. docs/endpoint.md ("Lost replicas in status") says why.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from hpcserve.core.files import read_json, write_json
from hpcserve.core.registry import Record
from hpcserve.core.runstate import RunState, read_timeline
from hpcserve.core.statuses import MemberRole, MemberStatus, RunKind, RunStatus
from hpcserve.core.timeline import stage_breakdown
from hpcserve.deployment.runs import run_of
from hpcserve.endpoint.control.holding import holding, read_backends, read_models
from hpcserve.endpoint.control.joining import dataplane_of
from hpcserve.endpoint.control.members import Member
from hpcserve.endpoint.control.run import EndpointCheck, MemberCheck, inspect_endpoint
from hpcserve.endpoint.protocol import ModelState, WakePhase, Waking
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
    admission_waiting: int = 0  # requests the data plane's admission keeps waiting now (dataplane/admission.py)
    up: int | None = None  # replicas answering now (count_replicas); None: count `replicas`
    total: int | None = None  # replicas in the pool + lost ones still counted: "up/total up"
    lost: list[dict] = field(default_factory=list)  # every lost member (Loss), counted or not
    models: list[dict] = field(default_factory=list)  # every model behind its URL (protocol.ModelRoom's JSON)
    sleep: str | None = None  # autoscale.min 0, no replica: "asleep" or "waking: queued 12 s (Resources)"
    swap: list[str] = field(default_factory=list)  # swap: which model is awake on which member, one line each

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
    members_now = [Member.from_json(m) for m in state.members]
    lost = {m.name for m in members_now if is_loss(m)}
    # A lost member's replica is not asked (its node may be dead): its URL may even answer again, as its
    # replacement's on the same node and port
    replicas = [{**rep, "healthy": False, "lost": True} if rep.get("member") in lost
                else {**rep, "healthy": (not gone) and health_ok(rep["url"])} for rep in state.replicas]
    acked = acknowledged(record.run_dir)
    count = count_replicas(replicas, members_now, acked, lost_nodes(replicas, members_now, acked))
    current = decide_status(current, count)
    stages = stage_breakdown(read_timeline(record.run_dir), record.created, state.job_started)
    members = [member_line(m) for m in members_now]
    decisions = [d.to_dict() for d in state.decisions]
    # What clients get, asked of the data plane: the controller's file says ready while a late successor
    # leaves the pool empty (endpoint/control/holding.py), and requests may wait for room in the KV caches
    answer, models, model = None, [], None
    if record.kind is RunKind.ENDPOINT and current in (RunStatus.READY, RunStatus.DEGRADED):
        admin_socket, model = dataplane_of(record)  # a joined model's data plane is its host's
        answer = read_backends(admin_socket, model)
        models = read_models(admin_socket) or []
    hold = holding(answer, members, decisions) if answer else None
    sleep = sleep_line(state.sleep, models, model, time.time())
    if sleep is not None:  # asleep or waking: what holds requests is the wake, said in its own words
        current, hold = RunStatus.WAKING if sleep.startswith("waking") else RunStatus.ASLEEP, None
    return DeploymentStatus(record.name, record.scheduler, RunStatus.HOLDING if hold else current, state.stage,
                            gone or run.runner_line(), record.run_dir, replicas,
                            state.error.to_dict() if state.error else None, record.job_id, stages,
                            state.endpoint_url, members, decisions, holding=hold,
                            admission_waiting=int(answer.get("waiting") or 0) if answer else 0,
                            up=count.up, total=count.total, lost=[asdict(loss) for loss in count.losses],
                            models=models, sleep=sleep, swap=swap_lines(state.swapped))


def swap_lines(swapped: dict) -> list[str]:
    """"NAME-m0 awake qwen (asleep: llama)" per member, "swapping" while a swap runs. Pure."""
    lines = []
    for member, models in sorted(swapped.items()):
        line = f"{member} awake {', '.join(models.get('awake') or []) or 'none'}"
        if models.get("asleep"):
            line += f" (asleep: {', '.join(models['asleep'])})"
        if models.get("swapping"):
            line += f"; swapping: {models['swapping'].get('sleep') or 'nothing'} to sleep, " \
                    f"{models['swapping'].get('wake')} waking"
        lines.append(line)
    return lines


def sleep_line(told: dict | None, models: list[dict], model: str | None, now: float) -> str | None:
    """"asleep", or "waking: queued 12 s (Resources)" / "waking: engine starting 40 s", for a model that
    sleeps when idle while the data plane has no replica of it (its GET /models says so); None otherwise.
    Pure."""
    room = next((m for m in models if m.get("name") == model or (model is None and m.get("own"))), None)
    if told is None or room is None or room.get("state") not in (ModelState.ASLEEP, ModelState.WAKING):
        return None
    waking = Waking.from_json(told)
    if room["state"] == ModelState.ASLEEP or waking.phase in (WakePhase.ASLEEP, WakePhase.SERVING):
        return f"asleep since {datetime.fromtimestamp(waking.since):%H:%M:%S}: a request wakes it (autoscale.min 0)"
    return f"waking: {waking.describe(now)}; requests wait up to {waking.wait_s:g} s (autoscale.wake_wait_s)"


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


# ------------------------------------------------------------------ lost replicas
ACK_FILE = "status_ack.json"  # in the run folder: the lost members the user acknowledged (`status --ack`)


@dataclass(frozen=True)
class Loss:
    """A member that served and then left without being drained on purpose."""

    member: str
    nodes: list[str]
    at: float | None  # when it was lost: its replacement's launch (launched in the round it left)
    why: str  # its note: the probe that failed, its job's end
    replicas: int
    stand_in: str | None  # the member in its place now (its chain of replacements and successors)
    stand_in_status: str | None  # that member's status; None: not replaced (yet, or self-healing gave up)
    acknowledged: bool
    counted: bool  # in status's "up/total" as a replica not up


@dataclass(frozen=True)
class ReplicaCount:
    up: int
    total: int
    losses: list[Loss]

    @property
    def counted(self) -> list[Loss]:
        return [loss for loss in self.losses if loss.counted]


def is_loss(member: Member) -> bool:
    """Served (joined the pool), then stopping, gone or failed, and not drained on purpose (a scale-down,
    a walltime handover, `down --member` retire it). A launch that never served is no lost replica."""
    return member.status.lost and not member.retired and member.ready_s is not None


def stand_in(member: Member, by_name: dict[str, Member]) -> tuple[Member, bool, bool]:
    """Along its chain of successors (replacements, walltime successors): who is in its place now (the
    chain's end; itself when nothing replaced it), whether a walltime handover is on the way there, and
    whether a later member on the way was lost too."""
    current, seen, handed, lost_again = member, {member.name}, False, False
    while current.successor in by_name and current.successor not in seen:
        current = by_name[current.successor]
        seen.add(current.name)
        handed |= current.role is MemberRole.SUCCESSOR
        lost_again |= is_loss(current)
    return current, handed, lost_again


def counts(end: Member, handed_over: bool, lost_again: bool, acknowledged: bool) -> bool:
    """Does a lost member count as a replica not up? end, handed_over, lost_again: stand_in's. Until the
    user acknowledged it, yes (a replacement serving does not undo the loss: the user should learn of
    it), unless a walltime handover renewed its replica since (a successor serves in its place).
    Acknowledged, only while nothing serves in its place (the replacement still starts, self-healing gave
    up) and no later loss in its place counts for that already. Pure."""
    if handed_over and end.status is MemberStatus.SERVING:
        return False
    if not acknowledged:
        return True
    missing = end.status is not MemberStatus.SERVING and not end.retired  # retired: given up on purpose
    return missing and not lost_again


def count_replicas(replicas: list[dict], members: list[Member], acknowledged: set[str] | frozenset = frozenset(),
                   nodes: dict[str, list[str]] | None = None) -> ReplicaCount:
    """What status's "up/total up" says. replicas: the pool's (each with 'healthy' checked now, and its
    'member' for an endpoint); members: the endpoint's, as its controller wrote them. Every replica of a
    member in the pool counts (up when healthy); a lost member counts as many replicas not up as it had
    while `counts` says so, in place of its own rows. Pure."""
    by_name = {m.name: m for m in members}
    losses = []
    for member in members:
        if not is_loss(member):
            continue
        end, handed, lost_again = stand_in(member, by_name)
        replaced_by = by_name.get(member.successor or "")
        losses.append(Loss(
            member.name, (nodes or {}).get(member.name, []), replaced_by.launched if replaced_by else None,
            member.note, len(member.backends) or int(member.layout.get("replicas") or 1),
            end.name if end is not member else None, str(end.status) if end is not member else None,
            member.name in acknowledged, counts(end, handed, lost_again, member.name in acknowledged)))
    lost = {loss.member for loss in losses}
    current = [r for r in replicas if r.get("member") not in lost]
    up = sum(1 for r in current if r["healthy"])
    return ReplicaCount(up, len(current) + sum(loss.replicas for loss in losses if loss.counted), losses)


def decide_status(current: RunStatus, count: ReplicaCount) -> RunStatus:
    """Ready, but fewer replicas up than counted: degraded. Pure."""
    if current is RunStatus.READY and count.total and count.up < count.total:
        return RunStatus.DEGRADED
    return current


def lost_line(name: str, status: str, up: int, total: int, losses: list[dict]) -> str | None:
    """The line under a deployment that says which lost replicas make it `degraded`, e.g. "degraded: 2/3
    up (sb-m1 on hsn2 lost at 12:04:31, replaced by sb-m3); `hpcserve status sb --ack` once seen".
    losses: Loss as dicts (status --json's 'lost'). Pure."""
    counted = [loss for loss in losses if loss["counted"]]
    if not counted:
        return None
    parts = []
    for loss in counted:
        where = f" on {','.join(loss['nodes'])}" if loss["nodes"] else ""
        when = f" at {time.strftime('%H:%M:%S', time.localtime(loss['at']))}" if loss["at"] else ""
        if loss["stand_in_status"] == MemberStatus.SERVING:
            after = f"replaced by {loss['stand_in']}"
        elif loss["stand_in"]:
            after = f"replacement {loss['stand_in']} {loss['stand_in_status']}"
        else:
            after = "not replaced"
        parts.append(f"{loss['member']}{where} lost{when}, {after}")
    waiting = [loss for loss in counted if not loss["acknowledged"]]
    ack = f"; `hpcserve status {name} --ack` once seen" if waiting else ""
    return f"{status}: {up}/{total} up ({'; '.join(parts)}){ack}"


def lost_nodes(replicas: list[dict], members: list[Member], acked: set[str]) -> dict[str, list[str]]:
    """Where each lost member ran: from its rows in the pool, else (adoption empties a lost member's
    backends) from its own state.json, read for those not acknowledged only (history is not read again
    at every status of a long-lived endpoint)."""
    out: dict[str, list[str]] = {}
    for rep in replicas:
        if rep.get("lost"):
            nodes = out.setdefault(rep["member"], [])
            nodes += [n for n in rep.get("nodes") or [] if n not in nodes]
    for member in members:
        if is_loss(member) and member.name not in out and member.name not in acked:
            try:
                out[member.name] = sorted({n for r in member.state().replicas for n in r.get("nodes") or []})
            except (OSError, ValueError):
                out[member.name] = []
    return out


def acknowledged(run_dir: str | Path) -> set[str]:
    return set((read_json(Path(run_dir) / ACK_FILE, {}) or {}).get("members") or [])


def acknowledge(record: Record) -> list[str]:
    """`hpcserve status NAME --ack`: every lost member of the endpoint so far is acknowledged (each stops
    counting once a replacement serves in its place). Returns those acknowledged now."""
    state = RunState.read(record.run_dir)
    seen = acknowledged(record.run_dir)
    new = sorted(m.name for m in map(Member.from_json, state.members) if is_loss(m) and m.name not in seen)
    if new:
        write_json(Path(record.run_dir) / ACK_FILE, {"members": sorted(seen | set(new)), "time": time.time()})
    return new
