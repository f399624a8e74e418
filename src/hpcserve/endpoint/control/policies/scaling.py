"""How many members serve: self-healing keeps their count (a member that was lost, not drained on purpose,
gets a replacement, until launches keep failing); autoscale follows the load (one more member when the
queue stays above target, an idle one drained; with autoscale.min 0 the last one too, after idle_s with
nothing in flight or held in the data plane: the model sleeps, and policies.sleeping wakes it; the decision
itself is decisions.decide_scale, pure)."""

from __future__ import annotations

import time

from hpcserve.core.config import AutoscaleSpec, Layout
from hpcserve.core.statuses import MemberRole, MemberStatus
from hpcserve.endpoint.control.decisions import LAUNCHES_PER_ROUND, decide_scale, place_replica, update_idle_since
from hpcserve.endpoint.control.members import single_replica
from hpcserve.endpoint.control.policies.base import ControlPlane

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
            successor = ctl.launch(MemberRole.REPLACEMENT, Layout(**member.layout), member.name, member.group,
                                   member.burst)  # where the lost one was (a preempted one: policies.preemption)
            member.successor = successor.name
            launched += 1

    def forget(self, url: str) -> None:
        pass


class Autoscaler:
    name = "scale"

    def __init__(self, spec: AutoscaleSpec | None):
        self.spec = spec
        self.idle_since: dict[str, float] = {}  # backend -> when it last had a request waiting or running
        self.last: dict | None = None  # the last decision, its reason and the load it saw (state.json)

    def step(self, ctl: ControlPlane) -> None:
        history = ctl.pool.history
        if self.spec is None or not history:
            return
        self.idle_since = update_idle_since(self.idle_since, history[-1], history[-2] if len(history) > 1 else None)
        starting = sum(1 for m in ctl.members if m.status is MemberStatus.LAUNCHING)
        serving = len(ctl.serving_backends())
        # The last replica of a model that sleeps goes only with nothing in flight or held: asked of the data plane
        plane = ctl.plane_load() if self.spec.sleeps and serving == 1 and not starting else None
        decision = decide_scale(self.spec, history, serving, starting, self.idle_since, time.time(), plane)
        self.last = {**decision.as_dict(), "waiting_per_replica": round(history[-1].waiting_per_replica(), 2),
                     "samples": len(history)}
        if decision.action == "up" and ctl.failed_launches >= MAX_FAILED_LAUNCHES:
            # No launch loop on a site where members cannot start: say it once, until one joins again.
            if not any(d.action == "scale up held" for d in ctl.decisions[-20:]):
                ctl.decide("scale up held", f"{decision.reason}, but the last {ctl.failed_launches} launches "
                           "never became ready; see their errors in `hpcserve status`")
            return
        if decision.action == "up":
            placement = place_replica(self.spec, *ctl.placed())
            if placement is None:  # decide_scale counted the same members: not expected
                ctl.decide("scale up held", f"{decision.reason}, but no partition has room")
                return
            ctl.decide("scale up", f"{decision.reason}; {placement.reason}")
            ctl.launch(MemberRole.SCALE_UP, single_replica(ctl.base_layout()), burst=placement.burst)
            history.clear()  # judge the next step on the load the new replica sees
        elif decision.action == "down" and decision.backend:
            ctl.decide("scale down", decision.reason)
            ctl.drain(decision.backend, f"drained: {decision.reason}")
        elif decision.action == "sleep" and decision.backend:
            # Out of the data plane first: a request from now on is held there and wakes the model
            ctl.decide("sleep", decision.reason)
            if not ctl.put_to_sleep(decision.backend, decision.reason):  # its engine sleeps in its allocation
                ctl.drain(decision.backend, f"asleep: {decision.reason}")
            history.clear()

    def forget(self, url: str) -> None:
        self.idle_since.pop(url, None)
