"""Walltime handover: before a member's job reaches its time limit, its successor is launched; once the
successor serves, the old member is drained (no request cut)."""

from __future__ import annotations

from datetime import datetime

from hpcserve.core.config import DeploymentConfig, Layout
from hpcserve.core.statuses import MemberRole, MemberStatus
from hpcserve.endpoint.decisions import LAUNCHES_PER_ROUND, handover_due, handover_lead_s
from hpcserve.endpoint.policy import ControlPlane


class Handover:
    name = "hand_over"

    def __init__(self, cfg: DeploymentConfig):
        self.on_slurm = cfg.cluster.scheduler == "slurm"
        self.configured_lead_s = cfg.serve.handover_s

    def step(self, ctl: ControlPlane) -> None:
        if not self.on_slurm:
            return
        launched, drains = 0, []
        for member in ctl.members:
            if member.status is not MemberStatus.SERVING:
                continue
            if member.successor:
                successor = ctl.member(member.successor)
                if successor.status is MemberStatus.SERVING:
                    drains += [(url, f"handed over to {successor.name}") for url in member.backends]
                elif successor.status.lost:
                    member.successor = None  # that one never served: start another next round
                continue
            lead = handover_lead_s(member.ready_s, self.configured_lead_s)
            if handover_due(member.end_time, datetime.now(), lead) and launched < LAUNCHES_PER_ROUND:
                launched += 1
                successor = ctl.launch(MemberRole.SUCCESSOR, Layout(**member.layout), member.name, member.group)
                member.successor = successor.name
                ctl.decide("hand over", f"{member.name} ends at {member.end_time}: successor {successor.name} "
                           f"started {lead:.0f} s ahead")
        if drains:
            ctl.drain_all(drains)

    def forget(self, url: str) -> None:
        pass
