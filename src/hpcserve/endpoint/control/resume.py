"""A new controller adopts what a lost one left running (its login node rebooted, a watchdog killed it).

The router and the members' jobs outlive the controller; everything needed to take them over is in the
run folder: state.json (members, their jobs or driver PIDs, their replicas' URLs, the router's PID and
the decisions so far), the config, the router's key file. Adoption, in this order:

    members   each one's job (or driver) checked now; a serving member whose replicas answer a real
              completion is adopted as it is (no restart); one that is starting is watched as before;
              one that is lost or fails the completion is replaced as usual (self-healing, next round)
    router    the recorded PID still our router on serve.port and answering: adopted, and its backend list
              made exactly the adopted replicas (what it holds that this controller did not put there
              leaves); else a new router on the same port with the same key and those replicas

Each step is a decision with its reason ("adopted", "adopt: lost", ...). What to do with each member is
decided by decisions.adopt_member (pure); this module carries it out.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from hpcserve.core.runstate import RunState
from hpcserve.core.statuses import Adoption, MemberStatus
from hpcserve.deployment.runs import run_of
from hpcserve.endpoint.control.controller import Controller
from hpcserve.endpoint.control.decisions import adopt_member, backend_changes
from hpcserve.endpoint.control.members import Member, replica_urls
from hpcserve.endpoint.control.plane_client import stop_router
from hpcserve.engine.client import completion_probe

ADOPTED = "adopted"
PROBE_TIMEOUT_S = 30.0  # a real completion of a few tokens; generous: a busy replica that fails it is replaced
CHECKS_AT_ONCE = 16


def resume(ctl: Controller, previous: RunState) -> str:
    """Take over the members and router `previous` (the lost controller's last state.json) describes.
    Returns a one-line summary for the timeline."""
    ctl.decisions = list(previous.decisions)
    ctl.members = [Member.from_json(m) for m in previous.members]
    # Every member is checked at once: while no router runs, clients wait for the slowest check, not
    # for their sum (a dead node's replica is refused at once, a busy one may take seconds).
    with ThreadPoolExecutor(max_workers=CHECKS_AT_ONCE) as pool:
        seen = list(pool.map(lambda member: examine(ctl, member), ctl.members))
    verdicts = [adopt_one(ctl, member, gone, probe_error) for member, (gone, probe_error) in zip(ctl.members, seen)]
    router = take_router(ctl, previous.router_pid, ctl.serving_backends())
    adopted = sum(1 for v in verdicts if v is Adoption.ADOPT)
    replaced = sum(1 for v in verdicts if v in (Adoption.LOST, Adoption.DROP))
    return f"router {router}; {adopted} member(s) adopted, {replaced} to replace"


def examine(ctl: Controller, member: Member) -> tuple[str | None, str | None]:
    """(why its job no longer serves, why a real completion failed): what adopt_member decides on."""
    gone = member_gone(member)
    return gone, probe(ctl, member) if member.status is MemberStatus.SERVING and not gone else None


def adopt_one(ctl: Controller, member: Member, gone: str | None, probe_error: str | None) -> Adoption:
    verdict, reason = adopt_member(member.status, gone, probe_error)
    if verdict is Adoption.KEEP:
        return verdict
    ctl.decide(ADOPTED if verdict is Adoption.ADOPT else f"adopt: {verdict}", f"{member.name} ({runner(member)}): {reason}")
    if verdict is Adoption.LOST or (verdict is Adoption.FINISH and gone):
        member.status, member.note, member.backends = MemberStatus.GONE, reason, []
    elif verdict is Adoption.DROP:
        member.backends = []  # not in the pool: the router's list is set from the adopted ones below
        ctl.stop_member(member, reason)
    elif verdict is Adoption.FINISH:
        finish(ctl, member, reason)
    return verdict  # ADOPT: nothing changes; it serves on and is probed from the next round


def member_gone(member: Member) -> str | None:
    """Why its job or driver can no longer serve, checked now; None while it runs (or starts)."""
    if member.status in (MemberStatus.GONE, MemberStatus.FAILED, MemberStatus.LAUNCHING):
        return None  # history, or left to its start watch (it reports a launch that ended)
    return run_of(member.as_record()).gone()


def probe(ctl: Controller, member: Member) -> str | None:
    """A real completion to each of its replicas, from here; the first failure, or None."""
    for url in member.backends:
        try:
            completion_probe(url, ctl.cfg.model.name, ctl.api_key, timeout_s=PROBE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure means: not adopted, replaced
            return f"{url}: {type(exc).__name__}: {exc}"[:300]
    return None


def finish(ctl: Controller, member: Member, reason: str) -> None:
    """Its predecessor was draining or stopping it: a drain waits for its requests to end, then stops it
    (the replica's URL from its own state, the member's list was emptied when the drain began)."""
    if member.status is MemberStatus.DRAINING:
        urls = replica_urls(member.state())
        ctl.stop_when_idle(member, urls, member.note or reason)
    else:
        ctl.stop_member(member, member.note or reason)


def runner(member: Member) -> str:
    record = member.as_record()
    return f"job {record.job_id}" if record.job_id else f"driver pid {record.driver_pid}"


def take_router(ctl: Controller, pid: int | None, wanted: list[str]) -> str:
    """Adopt the router if it still serves (its backend list made `wanted`), else start a new one on the
    same port with the same key and `wanted`. Returns what happened, in a few words."""
    router = ctl.router
    if router.attach(pid):
        ctl.decide(ADOPTED, f"router pid {pid} on {router.url} answers: kept, clients never noticed")
        own_backends(ctl, wanted)
        return f"pid {pid} adopted"
    if pid is not None and router.joined is None:  # a joined model's data plane is its host's to stop
        stop_router(pid, port=router.port)  # ours but not answering (hung): it holds the port
    router.start(wanted)
    ctl.decide("router restarted", f"no router answered on {router.url} (pid {pid} gone): a new one, pid "
               f"{router.pid}, same port and key, with the {len(wanted)} adopted replica(s)")
    return f"restarted (pid {router.pid})"


def own_backends(ctl: Controller, wanted: list[str]) -> None:
    """The router's backends become exactly `wanted`: what this controller does not know (or no longer
    wants) leaves, what it adopted is there."""
    remove, add = backend_changes([b.url for b in ctl.router.backends()], wanted)
    for url in remove:
        ctl.router.remove(url, drain_s=0)
        ctl.decide("adopt: removed backend", f"{url}: in the router, but not a replica this controller adopted")
    for url in add:
        ctl.router.add(url)
        ctl.decide("adopt: added backend", f"{url}: adopted, but the router did not hold it")
