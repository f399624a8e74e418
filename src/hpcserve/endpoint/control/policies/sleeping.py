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
from hpcserve.endpoint.control.decisions import (
    decide_idle,
    decide_release,
    decide_wake,
    decide_wake_how,
    wake_state,
)
from hpcserve.endpoint.control.members import Member, single_replica
from hpcserve.endpoint.control.plane_client import RouterError
from hpcserve.endpoint.control.policies.base import ControlPlane
from hpcserve.endpoint.control.policies.handover import recent_startups
from hpcserve.endpoint.control.policies.scaling import MAX_FAILED_LAUNCHES
from hpcserve.endpoint.protocol import Waking
from hpcserve.engine.client import engine_sleep, engine_wake_up
from hpcserve.slurm.states import JobInfo, JobState

log = logging.getLogger(__name__)

POSITION_EVERY_S = 30.0  # a queued replica's place in Slurm's queue asked this often (one squeue over all pending)
LISTEN_S = 10.0  # one GET /waking long poll waits this long for a request
RETRY_S = 1.0  # after the data plane did not answer


class Sleeper:
    name = "sleep"

    def __init__(self, spec: AutoscaleSpec | None, tries_sleep: bool = False):
        """tries_sleep: the engines may sleep (engine.sleep_mode not off): an idle last replica is asked to
        sleep in its allocation before it is stopped."""
        self.spec = spec if spec is not None and spec.sleeps else None
        self.tries_sleep = tries_sleep
        self.asleep: dict[str, float] = {}  # member name -> when its engine fell asleep (allocation kept)
        self.waking_up: dict[str, float] = {}  # member name -> when POST /wake_up was sent
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
        self.release(ctl, time.time())
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
        return (bool(ctl.serving_backends()) or bool(self.waking_up)
                or any(m.status is MemberStatus.LAUNCHING for m in ctl.members))

    def wake(self, ctl: ControlPlane, asked: int, held: int) -> None:
        starting = sum(1 for m in ctl.members if m.status is MemberStatus.LAUNCHING)
        decision = decide_wake(self.spec, len(ctl.serving_backends()), starting + len(self.waking_up), asked, held)
        if decision.action != "wake":
            return
        sleeper = next((m for m in ctl.members if m.status is MemberStatus.SLEEPING and m.name in self.asleep), None)
        how = decide_wake_how(sleeper.name if sleeper is not None else None)
        if how.action == "wake up" and sleeper is not None:
            ctl.decide("wake up", f"{decision.reason}; {how.reason}")
            self.waking_up[sleeper.name] = time.time()
            threading.Thread(target=self.wake_up, args=(ctl, sleeper), name=f"wake-{sleeper.name}", daemon=True).start()
            self.tell(ctl)
            return
        if ctl.failed_launches >= MAX_FAILED_LAUNCHES:
            if not any(d.action == "wake held" for d in ctl.decisions[-20:]):
                ctl.decide("wake held", f"{decision.reason}, but the last {ctl.failed_launches} launches never "
                           "became ready; see their errors in `hpcserve status`")
            return
        ctl.decide("wake", decision.reason)
        ctl.launch(MemberRole.SCALE_UP, single_replica(ctl.base_layout()))
        self.tell(ctl)

    # ------------------------------------------------------------ engines that sleep in their allocation
    def put_to_sleep(self, ctl: ControlPlane, backend: str, why: str) -> bool:
        """The autoscaler's sleep decision for the last replica (why): out of the data plane first (a request
        from now on is held and wakes the model), then its engine is asked to sleep, in a thread (offloading
        the weights takes seconds). True when this took the replica over (it sleeps, SLEEPING, or is stopped
        if its engine cannot sleep); False when engine.sleep_mode is off: the caller drains it as before."""
        member = next((m for m in ctl.members if m.status is MemberStatus.SERVING and backend in m.backends), None)
        if not self.tries_sleep or member is None:
            return False
        ctl.leave([(backend, f"asleep: {why}")])
        member.status, member.note = MemberStatus.SLEEPING, f"falling asleep: {why}"[:300]
        threading.Thread(target=self.fall_asleep, args=(ctl, member, backend, why), name=f"sleep-{member.name}",
                         daemon=True).start()
        return True

    def fall_asleep(self, ctl: ControlPlane, member: Member, backend: str, why: str) -> None:
        try:
            answered = engine_sleep(backend, ctl.pool.api_key)
        except Exception as exc:  # noqa: BLE001 - an engine that does not answer is stopped, as before
            answered, why = False, f"{why} (POST /sleep: {type(exc).__name__})"
        decision = decide_idle(True, answered, why)
        with ctl.lock:
            ctl.decide(decision.action, decision.reason)
            if decision.action == "sleep engine":
                member.note = f"asleep: {why}"[:300]
                self.asleep[member.name] = time.time()
                return
            member.retired = True
            ctl.stop_member(member, f"stopped: {decision.reason}"[:300])

    def wake_up(self, ctl: ControlPlane, member: Member) -> None:
        """POST /wake_up to the sleeping engine, then it rejoins the pool (the join's real completion first);
        one that does not wake is stopped, and the next round launches a new replica."""
        urls = list(member.backends)
        try:
            woke = all(engine_wake_up(url, ctl.pool.api_key) for url in urls)
            failed = ctl.pool.join(urls) if woke else {u: "POST /wake_up did not answer awake" for u in urls}
        except Exception as exc:  # noqa: BLE001 - reported as the member's note
            failed = {u: f"wake up: {type(exc).__name__}: {exc}"[:300] for u in urls}
        with ctl.lock:
            self.waking_up.pop(member.name, None)
            self.asleep.pop(member.name, None)
            if failed:
                ctl.decide("error", f"{member.name} did not wake: {next(iter(failed.values()))}"[:400])
                member.retired = True
                ctl.stop_member(member, "did not wake from sleep")
            else:
                member.status, member.note = MemberStatus.SERVING, "woken from sleep"
            self.tell(ctl)

    def release(self, ctl: ControlPlane, now: float) -> None:
        """A replica asleep for autoscale.release_after_s gives its allocation back (its job ends)."""
        spec = self.spec
        if spec is None:  # the model does not sleep: none is asleep
            return
        for name, since in list(self.asleep.items()):
            member = next((m for m in ctl.members if m.name == name), None)
            if member is None or member.status is not MemberStatus.SLEEPING:
                self.asleep.pop(name, None)
                continue
            decision = decide_release(spec.release_after_s, now - since)
            if decision.action == "release" and name not in self.waking_up:
                ctl.decide("release", f"{name}: {decision.reason}")
                self.asleep.pop(name, None)
                member.retired = True
                ctl.stop_member(member, f"released: {decision.reason}"[:300])

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
        spec = self.spec
        assert spec is not None, "only a model that sleeps has a wake (step returns at once otherwise)"
        serving = bool(ctl.serving_backends())
        member = next((m for m in ctl.members if m.status is MemberStatus.LAUNCHING), None)
        if member is None and self.waking_up:  # a sleeping engine waking in its allocation: the engine starts
            name, since = next(iter(self.waking_up.items()))
            return wake_state(spec.wake_wait_s, serving, (name, since), None, None, self.asleep_since, now)
        if not serving and member is None and self.told is not None and self.told.phase != "asleep":
            self.asleep_since = now
        job = ctl.job(member) if member is not None else None
        startups = recent_startups(ctl.members, None)
        startup_s = max(s.seconds for s in startups[-3:]) if startups else None
        return wake_state(spec.wake_wait_s, serving, waking_member(member), job, startup_s,
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

