"""Burst replicas on a preemptible partition (autoscale.burst): when Slurm takes one's nodes back, its job
gets USR1 at once (its --signal, with the site's preempt_send_user_signal) and the member writes a notice
(deployment.process.write_notice). Each round the controller reads the notices of its burst members that
serve, asks Slurm about the job once (scontrol: PreemptTime), drains the member at once (no new requests,
its streams move to the others: the handover path of a scale-down) and asks for a replacement where there
is room: the main partition first, else the burst one (decisions.decide_preemption, place_replica: pure).
The partition's GraceTime must cover the drain."""

from __future__ import annotations

import time

from hpcserve.core.config import AutoscaleSpec, Layout
from hpcserve.core.statuses import MemberRole, MemberStatus
from hpcserve.endpoint.control.decisions import decide_preemption, place_replica
from hpcserve.endpoint.control.members import Member
from hpcserve.endpoint.control.policies.base import ControlPlane


class Preemption:
    name = "preemption"

    def __init__(self, spec: AutoscaleSpec | None):
        self.spec = spec
        self.handled: set[str] = set()  # members whose notice was acted on

    def step(self, ctl: ControlPlane) -> None:
        if self.spec is None or self.spec.burst is None:
            return
        for member in list(ctl.members):
            if member.burst and member.status is MemberStatus.SERVING and member.name not in self.handled:
                notice = member.notice()
                if notice:
                    self.handled.add(member.name)
                    self.act(ctl, member, notice)

    def act(self, ctl: ControlPlane, member: Member, notice: dict) -> None:
        spec = self.spec
        assert spec is not None and spec.burst is not None, "step acts only for a model with a burst partition"
        decision = decide_preemption(member.name, notice, ctl.job_now(member), time.time())
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
