"""A model that sleeps when idle (autoscale.min 0): the autoscaler puts it to sleep (policies.scaling:
decisions.decide_sleep); this policy wakes it and tells the data plane where the wake stands.

    wake   a thread long-polls the data plane (GET /waking): a request that finds no replica returns it at
           once, and a replica is launched then (decisions.decide_wake), through the same launch as a
           scale-up; each round also looks at the requests held, so a failed launch is tried again while
           requests wait (up to MAX_FAILED_LAUNCHES in a row, as autoscale)
    tell   each round, the wake's phase (decisions.wake_state: asleep, queued with Slurm's reason,
           expected start and place in its partition's queue (asked every POSITION_EVERY_S), engine starting, serving) goes to the data plane when it changed (PUT /waking):
           it holds requests up to autoscale.wake_wait_s, sends streams SSE comments, refuses early with 503
           when Slurm expects the replica later, and /v1/models says it
"""

from __future__ import annotations

import logging
import threading
import time

from hpcserve.core.config import AutoscaleSpec
from hpcserve.core.statuses import MemberRole, MemberStatus
from hpcserve.endpoint.control.decisions import decide_wake, wake_state
from hpcserve.endpoint.control.members import Member, single_replica
from hpcserve.endpoint.control.plane_client import RouterError
from hpcserve.endpoint.control.policies.base import ControlPlane
from hpcserve.endpoint.control.policies.handover import recent_startups
from hpcserve.endpoint.control.policies.scaling import MAX_FAILED_LAUNCHES
from hpcserve.endpoint.protocol import Waking
from hpcserve.slurm.states import JobInfo, JobState

log = logging.getLogger(__name__)

POSITION_EVERY_S = 30.0  # a queued replica's place in Slurm's queue asked this often (one squeue over all pending)
LISTEN_S = 10.0  # one GET /waking long poll waits this long for a request
RETRY_S = 1.0  # after the data plane did not answer


class Sleeper:
    name = "sleep"

    def __init__(self, spec: AutoscaleSpec | None):
        self.spec = spec if spec is not None and spec.sleeps else None
        self.asked = -1  # the data plane's count of requests that found no replica, as last read
        self.told: Waking | None = None
        self.position: tuple[str, float, int | None] | None = None  # (member, asked at, its place in the queue)
        self.asleep_since = time.time()
        self.listener: threading.Thread | None = None
        self.closed = threading.Event()

    def step(self, ctl: ControlPlane) -> None:
        if self.spec is None:
            return
        if self.listener is None:
            self.listener = threading.Thread(target=self.listen, args=(ctl,), name="wake", daemon=True)
            self.listener.start()
        if not self.awake(ctl):  # requests held while no replica starts (a launch failed): wake again
            self.wake(ctl, 0, ctl.router.wakes().held)
        self.tell(ctl)

    def listen(self, ctl: ControlPlane) -> None:
        """The wake's thread: a request for the sleeping model launches a replica at once, not a round later."""
        while not self.closed.is_set() and not ctl.stop_requested:
            try:
                wakes = ctl.router.wakes(self.asked, LISTEN_S if self.asked >= 0 else 0.0)
            except RouterError as exc:
                log.debug("GET /waking: %s", exc)
                self.closed.wait(RETRY_S)
                continue
            new, self.asked = wakes.asked - self.asked if self.asked >= 0 else 0, wakes.asked
            if new or wakes.held:
                with ctl.lock:
                    self.wake(ctl, new, wakes.held)

    def awake(self, ctl: ControlPlane) -> bool:
        return bool(ctl.serving_backends()) or any(m.status is MemberStatus.LAUNCHING for m in ctl.members)

    def wake(self, ctl: ControlPlane, asked: int, held: int) -> None:
        starting = sum(1 for m in ctl.members if m.status is MemberStatus.LAUNCHING)
        decision = decide_wake(self.spec, len(ctl.serving_backends()), starting, asked, held)
        if decision.action != "wake":
            return
        if ctl.failed_launches >= MAX_FAILED_LAUNCHES:
            if not any(d.action == "wake held" for d in ctl.decisions[-20:]):
                ctl.decide("wake held", f"{decision.reason}, but the last {ctl.failed_launches} launches never "
                           "became ready; see their errors in `hpcserve status`")
            return
        ctl.decide("wake", decision.reason)
        ctl.launch(MemberRole.SCALE_UP, single_replica(ctl.base_layout()))
        self.tell(ctl)

    def tell(self, ctl: ControlPlane) -> None:
        """The wake's phase to the data plane, when it changed."""
        waking = self.state(ctl, time.time())
        if waking == self.told:
            return
        ctl.router.set_waking(waking)
        if waking.phase != (self.told.phase if self.told else None):
            log.info("model %s", waking.describe(time.time()))
        self.told = waking

    def state(self, ctl: ControlPlane, now: float) -> Waking:
        serving = bool(ctl.serving_backends())
        member = next((m for m in ctl.members if m.status is MemberStatus.LAUNCHING), None)
        if not serving and member is None and self.told is not None and self.told.phase != "asleep":
            self.asleep_since = now
        job = ctl.job(member) if member is not None else None
        startups = recent_startups(ctl.members, None)
        startup_s = max(s.seconds for s in startups[-3:]) if startups else None
        return wake_state(self.spec.wake_wait_s, serving, waking_member(member), job, startup_s,
                          self.asleep_since, now, self.queue_position(ctl, member, job, now))

    def queue_position(self, ctl: ControlPlane, member: Member | None, job: JobInfo | None, now: float) -> int | None:
        """The queued replica's place among its partition's pending jobs, asked every POSITION_EVERY_S."""
        if member is None or job is None or job.state is not JobState.PENDING:
            return None
        known = self.position
        if known is not None and known[0] == member.name and now - known[1] < POSITION_EVERY_S:
            return known[2]
        position = ctl.queue_position(member)
        self.position = (member.name, now, position)
        return position

    def told_json(self) -> dict | None:
        return self.told.to_json() if self.told is not None else None

    def close(self) -> None:
        self.closed.set()

    def forget(self, url: str) -> None:
        pass


def waking_member(member: Member | None) -> tuple[str, float] | None:
    return (member.name, member.launched) if member is not None else None

