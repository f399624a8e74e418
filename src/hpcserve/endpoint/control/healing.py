"""Self-healing: a member that was lost (not drained on purpose) gets a replacement, until launches keep
failing."""

from __future__ import annotations

from hpcserve.core.config import Layout
from hpcserve.core.statuses import MemberRole
from hpcserve.endpoint.control.decisions import LAUNCHES_PER_ROUND
from hpcserve.endpoint.control.policy import ControlPlane

MAX_FAILED_LAUNCHES = 3  # members in a row that never became ready: stop replacing, say why


class SelfHealing:
    name = "keep_count"

    def step(self, ctl: ControlPlane) -> None:
        launched = 0
        for member in ctl.members:
            if not member.status.lost or member.retired or member.successor:
                continue
            if launched >= LAUNCHES_PER_ROUND:
                return
            if ctl.failed_launches >= MAX_FAILED_LAUNCHES:
                member.successor = "none"
                ctl.decide("give up", f"{ctl.failed_launches} launches in a row never became ready: "
                           f"not replacing {member.name}; see its error in `hpcserve status`")
                continue
            successor = ctl.launch(MemberRole.REPLACEMENT, Layout(**member.layout), member.name, member.group)
            member.successor = successor.name
            launched += 1

    def forget(self, url: str) -> None:
        pass

