"""Burst replicas on a preemptible partition (autoscale.burst): when Slurm takes one's nodes back, its job
gets USR1 at once (its --signal, with the site's preempt_send_user_signal) and the member writes a notice
(deployment.process.write_notice). Each round the controller reads the notices of its burst members that
serve, asks Slurm about the job once (scontrol: PreemptTime), drains the member at once (no new requests,
its streams move to the others: the handover path of a scale-down) and asks for a replacement where there
is room: the main partition first, else the burst one (decisions.decide_preemption, place_replica: pure).
The partition's GraceTime must cover the drain. Slurm moves the job's end to the preemption's GraceTime as it
signals, so the end may show before the notice: a burst member whose end comes due is asked about once, and
one with a PreemptTime is taken as preempted then (this policy runs before the walltime handover's drain)."""

from __future__ import annotations

import time

from hpcserve.core.config import AutoscaleSpec, Layout
from hpcserve.core.statuses import MemberRole, MemberStatus
from hpcserve.endpoint.control.decisions import decide_preemption, end_drain_due, place_replica
from hpcserve.endpoint.control.members import Member
from hpcserve.endpoint.control.policies.base import ControlPlane
from hpcserve.slurm.parse import slurm_epoch
from hpcserve.slurm.states import JobInfo


class Preemption:
    name = "preemption"

    def __init__(self, spec: AutoscaleSpec | None):
        self.spec = spec
        self.handled: set[str] = set()  # members whose notice (or PreemptTime) was acted on
        self.asked: set[str] = set()  # members whose end came due without a notice: Slurm asked once

    def step(self, ctl: ControlPlane) -> None:
        if self.spec is None or self.spec.burst is None:
            return
        now = time.time()
        for member in list(ctl.members):
            if not member.burst or member.status is not MemberStatus.SERVING or member.name in self.handled:
                continue
            notice = member.notice()
            if notice:
                self.handled.add(member.name)
                self.act(ctl, member, notice, ctl.job_now(member), now)
            elif self.end_due(member, now) and member.name not in self.asked:
                self.asked.add(member.name)
                job = ctl.job_now(member)
                if job is not None and job.preempt_time is not None:
                    self.handled.add(member.name)
                    self.act(ctl, member, None, job, now)

    @staticmethod
    def end_due(member: Member, now: float) -> bool:
        ends = slurm_epoch(member.end_time)
        return ends is not None and end_drain_due(ends, now)

    def act(self, ctl: ControlPlane, member: Member, notice: dict | None, job: JobInfo | None, now: float) -> None:
        spec = self.spec
        assert spec is not None and spec.burst is not None, "step acts only for a model with a burst partition"
        decision = decide_preemption(member.name, notice, job, now)
        ctl.decide(decision.action, decision.reason)
        ctl.drain_all([(url, f"{decision.action}: {member.name}'s job ends soon") for url in list(member.backends)])
        if decision.action != "preempted":
            return  # its time limit: the walltime handover has (or launches) its successor
        placement = place_replica(spec, *ctl.placed(), replacing_preempted=True)
        if placement is None:
            ctl.decide("replace preempted", f"{member.name}: no room on the main partition (autoscale.max "
                       f"{spec.max}) nor the burst one (burst.max {spec.burst.max}): not replaced")
            return
        successor = ctl.launch(MemberRole.REPLACEMENT, Layout(**member.layout), member.name, member.group,
                               placement.burst)
        member.successor = successor.name
        ctl.decide("replace preempted", f"{member.name} by {successor.name} {placement.reason}")

    def forget(self, url: str) -> None:
        pass
