"""Walltime handover: before a member's job reaches its time limit a successor is launched, and once the
successor serves, the old member is drained (no request cut).

When, and in which order, is decided by endpoint.control.decisions from facts gathered here each round (the
formula is above its walltime section): Slurm's expected queue wait for a successor (sbatch --test-only,
at most once a minute), the startups of the members that joined last, each job's EndTime, and while a
successor starts, its job as Slurm reports it (its expected start while it waits, its start once it
runs). Every decision records the true figures: the time the old job had left, the lead planned and
what it was made of, and when the successor serves, how long its queue and startup really took.
Before anything starts, `up` judges the walltime by the same figures (handover_room).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from hpcserve.core.config import DeploymentConfig, Layout
from hpcserve.core.runstate import RunState
from hpcserve.core.statuses import MemberRole, MemberStatus
from hpcserve.deployment.preflight import walltime_check
from hpcserve.deployment.runs import expected_start
from hpcserve.endpoint.control.decisions import (
    END_DRAIN_S,
    Ending,
    Estimate,
    Lead,
    Startup,
    end_drain_due,
    expected_startup,
    handover_starts,
    handovers_due,
    projected_join,
    queue_estimate,
)
from hpcserve.endpoint.control.members import Member, member_config, single_replica
from hpcserve.endpoint.control.policies.base import ControlPlane
from hpcserve.endpoint.control.policies.scaling import MAX_FAILED_LAUNCHES
from hpcserve.planning.walltime import LOAD_BASE_S, WalltimeCheck
from hpcserve.slurm.parse import slurm_epoch, time_limit_seconds
from hpcserve.slurm.states import JobState

QUEUE_CHECK_EVERY_S = 60.0  # sbatch --test-only: slurmctld answers it like a submission, so at most this often
QUEUE_CHECK_FAR_S = 600.0  # ... and this seldom while the next handover is more than two leads away
JOB_CHECK_EVERY_S = 5.0  # a starting successor's job (sites rate-limit squeue)
LATE_REPORT_STEP_S = 60.0  # a late successor is reported again when its projection moves this much


@dataclass
class Launched:
    """A successor's plan, kept for the decisions that follow it."""

    predecessor: str
    lead: Lead
    left_s: float  # what the predecessor's job had left when the successor was launched
    projected: float | None = None  # when it should serve, as last projected
    reported: float | None = None  # the projection last reported as late


class Handover:
    name = "hand_over"

    def __init__(self, cfg: DeploymentConfig, clock: Callable[[], float] = time.time):
        self.on_slurm = cfg.cluster.scheduler == "slurm"
        self.ahead = cfg.hands_over  # off: no successor before a job's end, one at its end (orphans)
        self.configured_lead_s = cfg.serve.handover_s
        self.startup_estimate = (Estimate(cfg.serve.startup_s, "serve.startup_s") if cfg.serve.startup_s
                                 else Estimate(LOAD_BASE_S, "estimated: none measured"))
        self.walltime_s = time_limit_seconds(cfg.cluster.time)
        self.clock = clock
        self.queue: dict[int, Estimate] = {}  # replica group -> the wait Slurm expects for a successor
        self.queue_asked: dict[int, float] = {}
        self.launched: dict[str, Launched] = {}  # successor -> its plan
        self.job_checked: dict[str, float] = {}
        self.handing: set[str] = set()  # members handed over (or drained at their end) until a successor serves
        self.said: set[str] = set()  # one-time warnings already decided
        self.leads: dict[int, Lead] = {}  # replica group -> its lead, this round

    def step(self, ctl: ControlPlane) -> None:
        if not self.on_slurm:
            return
        now = self.clock()
        self.leads.clear()  # the facts of this round: startups measured so far, the queue as last asked
        self.take_over(ctl, now)
        self.follow(ctl, now)
        self.drain_at_end(ctl, now)
        self.launch_due(ctl, now)

    def forget(self, url: str) -> None:
        pass

    # ------------------------------------------------------------ successors that serve, or failed
    def take_over(self, ctl: ControlPlane, now: float) -> None:
        for member in ctl.members:
            successor = successor_of(ctl, member)
            if successor is None:
                continue
            if successor.status is MemberStatus.SERVING and (member.name in self.handing
                                                             or member.status is MemberStatus.SERVING):
                self.handed_over(ctl, member, successor, now)
            elif successor.status.lost and successor.ready_s is None:
                # Never served: the next round launches another (if launches still succeed somewhere)
                member.successor = None

    def handed_over(self, ctl: ControlPlane, member: Member, successor: Member, now: float) -> None:
        self.handing.discard(member.name)
        plan = self.launched.pop(successor.name, None)
        ends = slurm_epoch(member.end_time)
        left = f"{ends - now:.0f} s" if ends else "unknown time"
        planned = (f"; planned lead {plan.lead.seconds:.0f} s, launched with {plan.left_s:.0f} s left"
                   if plan else "")
        took = (f" (queue {(successor.ready_s or 0) - (successor.startup_s or 0):.0f} s, startup "
                f"{successor.startup_s or 0:.0f} s)")
        if member.status is MemberStatus.SERVING:
            ctl.decide("handed over", f"{successor.name} serves{took}; {member.name}'s job had {left} left"
                       f"{planned}: {member.name} drained")
            for url in list(member.backends):
                ctl.drain(url, f"handed over to {successor.name}")
        else:
            ctl.decide("handed over", f"{successor.name} serves{took}, after {member.name} had stopped at its "
                       f"job's end{planned}")

    # ------------------------------------------------------------ successors that start
    def follow(self, ctl: ControlPlane, now: float) -> None:
        """Re-plan while a successor waits or starts: when it should serve, from its job as Slurm reports
        it now; a projection past the moment its predecessor stops taking requests is reported."""
        for name, plan in list(self.launched.items()):
            successor = ctl.member(name)
            if successor.status is not MemberStatus.LAUNCHING:
                if successor.status.lost:
                    self.launched.pop(name)
                continue
            if now - self.job_checked.get(name, float("-inf")) < JOB_CHECK_EVERY_S:
                continue
            self.job_checked[name] = now
            info = ctl.job(successor)
            if info is None or info.state.finished:
                continue
            pending = info.state is JobState.PENDING
            startup = self.lead(ctl, successor.group).startup
            plan.projected = projected_join(pending, slurm_epoch(info.start_time), startup.seconds, now)
            if plan.projected is not None:
                successor.note = f"{info.describe()}; expected to serve at {clock_text(plan.projected)}"
            self.report_late(ctl, successor, plan, pending, info.start_time)

    def report_late(self, ctl: ControlPlane, successor: Member, plan: Launched, pending: bool,
                    start: str | None) -> None:
        predecessor = ctl.member(plan.predecessor)
        ends = slurm_epoch(predecessor.end_time)
        if plan.projected is None or ends is None:
            return
        late = plan.projected - (ends - END_DRAIN_S)
        moved = plan.reported is None or plan.projected - plan.reported >= LATE_REPORT_STEP_S
        if late <= 0 or not moved:
            return
        plan.reported = plan.projected
        why = (f"Slurm expects its job to start at {start}" if pending else f"its job started at {start}")
        others = [u for u in ctl.serving_backends() if u not in predecessor.backends]
        bridge = ("the other replicas serve meanwhile" if others else
                  "it is the last replica: the data plane holds new requests until one joins (serve.hold_s)")
        ctl.decide("successor late", f"{successor.name} should serve at {clock_text(plan.projected)} ({why}, "
                   f"startup ~{self.lead(ctl, successor.group).startup.seconds:.0f} s): {late:.0f} s after "
                   f"{predecessor.name} stops taking requests, {END_DRAIN_S:.0f} s before its job ends; {bridge}")

    # ------------------------------------------------------------ the end of a job
    def drain_at_end(self, ctl: ControlPlane, now: float) -> None:
        """A job about to end is drained, so that Slurm's TERM cuts no request; it stayed in the pool
        until now (the endpoint never gives up a replica it has not replaced before it must)."""
        for member in ctl.members:
            ends = slurm_epoch(member.end_time)
            if member.status is not MemberStatus.SERVING or ends is None or not end_drain_due(ends, now):
                continue
            others = [u for u in ctl.serving_backends() if u not in member.backends]
            bridge = ("the other replicas serve" if others else
                      "it was the last replica: the data plane holds new requests until one joins (serve.hold_s)")
            waiting = (f"its successor {member.successor} does not serve yet" if member.successor
                       else "it has no successor")
            why = f"its job ends in {ends - now:.0f} s and {waiting}: drained so that no request is cut; {bridge}"
            ctl.decide("drain at job end", f"{member.name}: {why}")
            self.handing.add(member.name)
            for url in list(member.backends):
                ctl.drain(url, f"job ends in {ends - now:.0f} s")

    # ------------------------------------------------------------ launching successors
    def launch_due(self, ctl: ControlPlane, now: float) -> None:
        orphans = [m for m in ctl.members if m.name in self.handing and not m.successor
                   and m.status is not MemberStatus.SERVING]
        endings = self.endings(ctl, now) if self.ahead else []
        in_handover = [m.name for m in ctl.members
                       if (s := successor_of(ctl, m)) and s.status is MemberStatus.LAUNCHING]
        calls = [(ctl.member(c.member), c.reason, c.left_s) for c in handovers_due(endings, in_handover, now)]
        calls = [(m, "it stopped taking requests at its job's end without a successor", 0.0) for m in orphans] + calls
        if not calls:
            return
        if ctl.failed_launches >= MAX_FAILED_LAUNCHES:
            self.say_once(ctl, "hand over held", f"{', '.join(m.name for m, _, _ in calls)} due for a successor, "
                          f"but the last {ctl.failed_launches} launches never became ready; see their errors in "
                          "`hpcserve status`")
            return
        for member, reason, left in calls:
            self.launch(ctl, member, reason, left)

    def launch(self, ctl: ControlPlane, member: Member, reason: str, left_s: float) -> None:
        lead = self.lead(ctl, member.group)
        successor = ctl.launch(MemberRole.SUCCESSOR, Layout(**member.layout), member.name, member.group,
                               member.burst)  # a burst replica's successor stays on the burst partition
        member.successor = successor.name
        self.handing.add(member.name)
        self.launched[successor.name] = Launched(member.name, lead, left_s)
        ctl.decide("hand over", f"{member.name} (job ends at {member.end_time or '?'}): successor {successor.name} "
                   f"launched with {left_s:.0f} s left, because {reason}; {lead.describe()}")

    def endings(self, ctl: ControlPlane, now: float) -> list[Ending]:
        """Serving members without a successor whose job has a limit, each with its lead (facts refreshed)."""
        out = []
        for member in ctl.members:
            ends = slurm_epoch(member.end_time)
            if member.status is not MemberStatus.SERVING or member.successor or ends is None:
                continue
            out.append(self.ending(ctl, member, ends))
        self.refresh_queue(ctl, out, now)
        out = [self.ending(ctl, ctl.member(e.member), e.ends) for e in out]
        for ending in out:
            self.check_walltime(ctl, ctl.member(ending.member).group)
        return out

    def ending(self, ctl: ControlPlane, member: Member, ends: float) -> Ending:
        lead = self.lead(ctl, member.group)
        return Ending(member.name, ends, lead.seconds, lead.expected_s)

    # ------------------------------------------------------------ the facts
    def lead(self, ctl: ControlPlane, group: int) -> Lead:
        if group not in self.leads:
            self.leads[group] = self.planned_lead(ctl, group)
        return self.leads[group]

    def planned_lead(self, ctl: ControlPlane, group: int) -> Lead:
        startups = recent_startups(ctl.members, group) or recent_startups(ctl.members, None)
        startup = expected_startup(startups, self.startup_estimate)
        queue = self.queue.get(group, Estimate(0.0, "not asked yet"))
        return Lead(queue, startup, self.configured_lead_s)

    def refresh_queue(self, ctl: ControlPlane, endings: list[Ending], now: float) -> None:
        """Ask Slurm when a successor would start: every minute while a handover is near (two leads),
        every ten minutes before."""
        starts = handover_starts(endings)
        for ending in endings:
            member = ctl.member(ending.member)
            near = starts[ending.member] - now < 2 * ending.lead_s
            every = QUEUE_CHECK_EVERY_S if near else QUEUE_CHECK_FAR_S
            if now - self.queue_asked.get(member.group, float("-inf")) < every:
                continue
            self.queue_asked[member.group] = now
            will_run = ctl.expected_start(Layout(**member.layout), member.group)
            self.leads.pop(member.group, None)
            self.queue[member.group] = queue_estimate(slurm_epoch(will_run.start) if will_run else None, now,
                                                      clock_text(now))

    def check_walltime(self, ctl: ControlPlane, group: int) -> None:
        """Measured figures that leave a job less than a quarter of its time to serve: said once, with the
        walltime that would work (the endpoint carries on; `up` refuses such a config before it starts)."""
        if self.walltime_s is None:
            return
        lead = self.lead(ctl, group)
        check = WalltimeCheck(self.walltime_s, lead.startup.seconds, lead.queue.seconds, lead.startup.basis,
                              lead.queue.basis)
        problem = check.problem("cluster.time")
        if problem:
            self.say_once(ctl, "walltime too short", problem, key=f"walltime {check.walltime_that_works_s:.0f}")

    def say_once(self, ctl: ControlPlane, action: str, reason: str, key: str | None = None) -> None:
        key = key or action
        if key not in self.said:
            self.said.add(key)
            ctl.decide(action, reason)


def successor_of(ctl: ControlPlane, member: Member) -> Member | None:
    """Its walltime successor, if it has one (self-healing's replacements are followed by self-healing)."""
    if not member.successor or member.successor == "none":
        return None
    successor = ctl.member(member.successor)
    return successor if successor.role is MemberRole.SUCCESSOR else None


def recent_startups(members: list[Member], group: int | None) -> list[Startup]:
    """Measured startups, oldest join first (of one replica group, or of all)."""
    joined = [m for m in members if m.startup_s is not None and (group is None or m.group == group)]
    joined.sort(key=lambda m: m.launched + (m.ready_s or 0.0))
    return [Startup(m.name, m.startup_s, m.under_load) for m in joined if m.startup_s is not None]


def clock_text(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).strftime("%H:%M:%S")


def last_run_startup(results: Path, name: str) -> Estimate | None:
    """The startup measured in the last run of this endpoint that measured one (its state.json's members),
    for `up` to judge the walltime by before it starts anything; None when none did."""
    for run_dir in sorted((results / "logs").glob(f"{name}-endpoint-*"), reverse=True):
        members = [Member.from_json(m) for m in RunState.read(run_dir).members]
        startups = recent_startups(members, None)
        if startups:
            found = expected_startup(startups, Estimate(0.0, ""))
            return Estimate(found.seconds, f"{found.basis}, in the last run {run_dir.name}")
    return None


def handover_room(cfg: DeploymentConfig, model_path: str, layout: Layout | None) -> WalltimeCheck | None:
    """What the walltime leaves to serve behind an endpoint on Slurm, for `up` to judge before it starts
    anything: Slurm's queue estimate for one member now (sbatch --test-only, nothing queued) and the
    startup measured in this deployment's last run, else estimated (deployment.preflight.walltime_check)."""
    if not cfg.hands_over or time_limit_seconds(cfg.cluster.time) is None:
        return None
    results = Path(cfg.results_dir).resolve()
    member = member_config(cfg, f"{cfg.name}-m0", 0, single_replica(layout or Layout()), results)
    measured = last_run_startup(results, cfg.name)
    return walltime_check(cfg, model_path, expected_start(member, results), time.time(),
                          (measured.seconds, measured.basis) if measured else None)
