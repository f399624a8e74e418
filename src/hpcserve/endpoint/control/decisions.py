"""The endpoint controller's decisions, as pure functions over what it observed (tested without a cluster).

- health:   when a backend leaves the pool (failed probes) and when a joining one may take traffic
- autoscale: when to add a replica (queue above target for a while) or drain one (idle for a while); with
             autoscale.min 0, when the model sleeps (its last replica idle for idle_s, nothing in flight or
             held) and when a request wakes it
- walltime: when a job must get its successor, so the endpoint outlives the job's time limit
- adoption: what a new controller does with each member and backend a lost controller left running
- swap:     which model of several sharing one member's GPUs wakes for its requests, and which sleeps for it
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from hpcserve.core.config import AutoscaleSpec
from hpcserve.core.statuses import Adoption, MemberRole, MemberStatus
from hpcserve.endpoint.protocol import WakePhase, Waking
from hpcserve.engine.metrics import EngineLoad
from hpcserve.planning.walltime import HANDOVER_MARGIN_S, HANDOVER_STARTUP_FACTOR, handover_lead_s
from hpcserve.slurm.parse import slurm_epoch
from hpcserve.slurm.states import JobInfo, JobState

# A backend whose probes failed this many times in a row leaves the pool. With a probe every second
# and a one-second timeout, a dead backend is out within about 3 s.
FAILED_PROBES_TO_LEAVE = 2
# An engine that took the connection but answered late (a read timeout) is alive and busy, not dead: a
# replica batching at its limit on a loaded machine answered /health in over a second, and stopping it
# after two such probes cut the streams it was serving (the heterogeneous-pool test, 2026-12-02). It
# is skipped for new requests at once (endpoint.control.pool: suspect) and leaves only after this many late
# probes in a row (20-40 s: one probe at a time, each up to its timeout): a frozen engine still goes.
SLOW_PROBES_TO_LEAVE = 20
# Launches (replacements, successors) in one round, the rest in the next ones: when 10 % of 256 replicas
# are lost at once, or 256 jobs started together reach their time limit together, 25 or 256 sbatch in
# one round would hold it for seconds and hit slurmctld as a burst; four a round spread them out.
LAUNCHES_PER_ROUND = 4


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str = ""
    late: bool = False  # failed by answering too late (connected, no answer in time): busy or frozen


def failed_in_a_row(recent: list[ProbeResult], count: int) -> bool:
    tail = recent[-count:]
    return len(tail) == count and not any(p.ok for p in tail)


def is_suspect(recent: list[ProbeResult]) -> bool:
    """The last FAILED_PROBES_TO_LEAVE probes all failed, late: skipped for new requests, not yet left."""
    return failed_in_a_row(recent, FAILED_PROBES_TO_LEAVE) and all(p.late for p in recent[-FAILED_PROBES_TO_LEAVE:])


def should_leave(recent: list[ProbeResult]) -> bool:
    """The last FAILED_PROBES_TO_LEAVE probes all failed and one of them was not late (refused, a
    connect timeout, /health not 200), or the last SLOW_PROBES_TO_LEAVE all failed (late or not)."""
    if not failed_in_a_row(recent, FAILED_PROBES_TO_LEAVE):
        return False
    return not is_suspect(recent) or failed_in_a_row(recent, SLOW_PROBES_TO_LEAVE)


def leave_reason(recent: list[ProbeResult]) -> str:
    """Why a backend that should_leave leaves, for its decision and its member's note."""
    count = SLOW_PROBES_TO_LEAVE if is_suspect(recent) else FAILED_PROBES_TO_LEAVE
    return f"failed {count} probes in a row: {recent[-1].detail}"


def probes_due(backends: list[str], last_started: dict[str, float], now: float, every_s: float,
               step_s: float) -> list[str]:
    """The backends to probe (/health and /metrics) in this step of the controller's loop (one every
    step_s). Each is probed every every_s, and a step probes at most its share of the pool (the most
    overdue first), so the probes of 256 replicas spread evenly over the second instead of 512
    requests in one burst each round; replicas that joined together drift apart within a second.
    Pure."""
    share = max(1, math.ceil(len(backends) * step_s / every_s))
    due = sorted((last_started.get(url, float("-inf")), url) for url in backends
                 if now - last_started.get(url, float("-inf")) >= every_s - step_s / 2)
    return [url for _, url in due[:share]]


def reads_due(backends: list[str], loads: dict[str, EngineLoad], paused: set[str], last_read: dict[str, float],
              now: float, busy_every_s: float, idle_every_s: float) -> list[str]:
    """The backends whose /metrics the load-aware rotation reads now. One with requests running or
    waiting, or paused (it must come back as soon as its queue empties), or whose load is not known
    yet, is read every busy_every_s; an idle one every idle_every_s (the round's probe reads it
    anyway): at 256 replicas an idle endpoint costs 256 page reads a second, not 1,280 (a page is
    50 KB). A request that lands on an idle replica is seen by the next probe or by the router's own
    balancing. Pure."""
    def every(url: str) -> float:
        load = loads.get(url)
        busy = url in paused or load is None or load.in_flight > 0
        return busy_every_s if busy else idle_every_s

    # A little early is on time: reads are scheduled by a loop that wakes every busy_every_s
    return [url for url in backends if now - last_read.get(url, float("-inf")) >= every(url) - busy_every_s / 2]


# ------------------------------------------------------------------ autoscale

@dataclass(frozen=True)
class LoadSample:
    """One scrape of every active backend: requests waiting and running on each (from /metrics), and those
    the data plane keeps waiting for the model (its admission: fair share holds a user's excess there, not
    in the engines' queues)."""

    time: float
    waiting: dict[str, float]
    running: dict[str, float]
    finished: dict[str, float] = field(default_factory=dict)  # each engine's finished-requests counter
    queued: int = 0  # waiting in the data plane

    def waiting_per_replica(self) -> float:
        return (sum(self.waiting.values()) + self.queued) / max(1, len(self.waiting))


@dataclass(frozen=True)
class PlaneLoad:
    """What the data plane counts for the model now: requests in flight through it, and held (no replica)."""

    in_flight: int
    held: int


@dataclass(frozen=True)
class ScaleDecision:
    action: Literal["up", "down", "hold", "sleep", "wake", "preempted", "job ending"]
    reason: str
    backend: str | None = None  # for "down": the one to drain

    def as_dict(self) -> dict:
        return {"action": self.action, "reason": self.reason, "backend": self.backend}


def decide_scale(spec: AutoscaleSpec, history: list[LoadSample], replicas: int, starting: int,
                 idle_since: dict[str, float], now: float, plane: PlaneLoad | None = None) -> ScaleDecision:
    """replicas: backends taking traffic; starting: replicas submitted but not yet in the pool;
    idle_since: backend -> when it last had a request waiting or running; plane: the data plane's counts
    (asked only when the last replica of a model that sleeps may go: decide_sleep)."""
    total = replicas + starting
    if total < spec.min:
        return ScaleDecision("up", f"{total} replica(s) running or starting, fewer than autoscale.min {spec.min}")
    if starting:
        return ScaleDecision("hold", f"{starting} replica(s) still starting")
    window = [s for s in history if s.time >= now - spec.scale_up_after_s]
    covered = bool(history) and history[0].time <= now - spec.scale_up_after_s
    if covered and window and all(s.waiting_per_replica() > spec.target_queue for s in window):
        queue = min(s.waiting_per_replica() for s in window)
        if total >= spec.total_max:
            return ScaleDecision("hold", f"{queue:.1f} waiting per replica > target {spec.target_queue:g}, "
                                 f"but already at autoscale.max {spec.max}"
                                 + (f" + burst.max {spec.burst.max}" if spec.burst else ""))
        return ScaleDecision("up", f"at least {queue:.1f} requests waiting per replica for {spec.scale_up_after_s:g} s "
                             f"(target {spec.target_queue:g})")
    last = replicas == 1 and spec.sleeps  # the last replica of a model that sleeps: idle_s, not scale_down_after_s
    after_s = spec.idle_s if last and spec.idle_s is not None else spec.scale_down_after_s
    idle = sorted((since, backend) for backend, since in idle_since.items() if now - since >= after_s)
    if idle and replicas > spec.min:
        since, backend = idle[0]
        if last:
            return decide_sleep(spec, backend, now - since, plane)
        return ScaleDecision("down", f"{backend} idle for {now - since:.0f} s (>= {spec.scale_down_after_s:g} s) and "
                             f"{replicas} replicas > autoscale.min {spec.min}", backend)
    return ScaleDecision("hold", "load within target")


def decide_sleep(spec: AutoscaleSpec, backend: str, idle_for: float, plane: PlaneLoad | None) -> ScaleDecision:
    """The model's last replica, idle for idle_for >= autoscale.idle_s: it goes (the model sleeps) only when
    the data plane has no request for the model in flight or held now (the engines' figures are a probe
    late; a request that arrives after this look is held and wakes the model: decide_wake). Pure."""
    if plane is None:
        return ScaleDecision("hold", f"{backend} idle for {idle_for:.0f} s, but the data plane's counts are not "
                             "known: not asleep yet")
    if plane.in_flight or plane.held:
        return ScaleDecision("hold", f"{backend} idle for {idle_for:.0f} s by its engine, but the data plane has "
                             f"{plane.in_flight} request(s) in flight and {plane.held} held: not asleep")
    return ScaleDecision("sleep", f"{backend} idle for {idle_for:.0f} s (>= autoscale.idle_s {spec.idle_s:g}), no "
                         "request in flight or held: the model sleeps (autoscale.min 0), a request wakes it", backend)


def decide_wake(spec: AutoscaleSpec | None, replicas: int, starting: int, asked: int, held: int) -> ScaleDecision:
    """A model that sleeps, with no replica serving or starting: one is launched when a request asked for it
    (asked: requests that found no replica since the last look) or one is held now. Pure."""
    if spec is None or not spec.sleeps:
        return ScaleDecision("hold", "the model does not sleep (autoscale.min >= 1)")
    if replicas or starting:
        return ScaleDecision("hold", f"{replicas} replica(s) serving, {starting} starting: awake")
    if not asked and not held:
        return ScaleDecision("hold", "asleep: no request for the model")
    return ScaleDecision("wake", f"{max(asked, held)} request(s) for the sleeping model and no replica serving or "
                         "starting: one launched (the requests wait up to autoscale.wake_wait_s "
                         f"{spec.wake_wait_s:g} s)")


def wake_state(wait_s: float, serving: bool, member: tuple[str, float] | None, job: JobInfo | None,
               startup_s: float | None, asleep_since: float, now: float, position: int | None = None) -> Waking:
    """Where a model that sleeps stands, for the data plane (PUT /waking). member: the one launching to serve
    (name, launched at), None when none is; job: its Slurm job as Slurm reports it (None: a local process, or
    not known yet); startup_s: the startup measured (job start to serving), None before any. ready_at is
    given only from Slurm's expected start or a measured startup, never guessed: the data plane refuses
    early only on it. position: the pending job's place in its partition's queue (SlurmClient.queue_position),
    None when not known. Pure."""
    if serving:
        return Waking(WakePhase.SERVING, asleep_since, wait_s)
    if member is None:
        return Waking(WakePhase.ASLEEP, asleep_since, wait_s)
    name, launched = member
    if job is not None and job.state is JobState.PENDING:
        start = slurm_epoch(job.start_time)
        ready = start + (startup_s or 0.0) if start is not None else None
        return Waking(WakePhase.QUEUED, launched, wait_s, job.reason, position, ready, name)
    started = (slurm_epoch(job.start_time) if job is not None else None) or launched
    return Waking(WakePhase.STARTING, started, wait_s, None, None,
                  started + startup_s if startup_s is not None else None, name)


@dataclass(frozen=True)
class IdleDecision:
    """What becomes of a model's last replica once it may go (decide_sleep), of a sleeping one, and how a
    model at zero wakes (engine.sleep_mode: vLLM's sleep keeps the job and frees the GPU memory)."""

    action: Literal["sleep engine", "stop", "release", "hold", "wake up", "launch"]
    reason: str


def decide_idle(tries_sleep: bool, answered: bool | None, why: str) -> IdleDecision:
    """The last replica goes (why: decide_sleep's reason). tries_sleep: engine.sleep_mode is not off;
    answered: whether its engine slept when asked (POST /sleep: True; False: it has no sleep mode, as vLLM on
    CPU or one started without --enable-sleep-mode answers 404; None: not asked yet). Pure."""
    if not tries_sleep:
        return IdleDecision("stop", f"{why}; engine.sleep_mode off: its job ends")
    if answered is None:
        return IdleDecision("sleep engine", f"{why}; its engine is asked to sleep (engine.sleep_mode): the job keeps "
                            "its allocation, GPU memory is freed, a request wakes it in seconds")
    if answered:
        return IdleDecision("sleep engine", f"{why}; its engine sleeps (weights in host RAM, GPU memory freed, the "
                            "allocation kept): a request wakes it with POST /wake_up")
    return IdleDecision("stop", f"{why}; its engine cannot sleep (no /sleep: vLLM on CPU, or started without "
                        "sleep mode): its job ends instead")


def decide_release(release_after_s: float, asleep_for: float) -> IdleDecision:
    """A sleeping replica keeps its allocation up to autoscale.release_after_s; then its job ends. Pure."""
    if asleep_for >= release_after_s:
        return IdleDecision("release", f"asleep {asleep_for:.0f} s (>= autoscale.release_after_s "
                            f"{release_after_s:g} s): its allocation is released (the job ends); the next "
                            "request waits for a new job")
    return IdleDecision("hold", f"asleep {asleep_for:.0f} s, its allocation kept up to {release_after_s:g} s")


def decide_wake_how(sleeping: str | None) -> IdleDecision:
    """A model at zero must wake (decide_wake): the replica sleeping in its allocation, if there is one, is
    woken (seconds); else a new one is launched (a job queued, the engine loaded). Pure."""
    if sleeping is not None:
        return IdleDecision("wake up", f"{sleeping} sleeps in its allocation: woken (POST /wake_up), much faster "
                            "than a new job")
    return IdleDecision("launch", "no replica sleeps in an allocation: a new one is launched")


def update_idle_since(idle_since: dict[str, float], sample: LoadSample,
                      previous: LoadSample | None = None) -> dict[str, float]:
    """A backend with nothing waiting or running, and no request finished since the previous sample, keeps
    its idle start; a busy one is reset to now. (Short requests between two samples are seen only by the
    finished counter: without it, a replica serving one quick request every few seconds looks idle.)"""
    out = {}
    for backend in sample.waiting:
        busy = sample.waiting.get(backend, 0) + sample.running.get(backend, 0) > 0
        if previous is not None and backend in sample.finished and backend in previous.finished:
            busy = busy or sample.finished[backend] > previous.finished[backend]
        out[backend] = sample.time if busy else idle_since.get(backend, sample.time)
    return out


def replace_failed_launch(role: MemberRole) -> bool:
    """Does self-healing replace a member that failed before it served? Not a scale-up or a successor:
    the autoscaler and the walltime handover decide again next round whether one is still needed, and a
    replacement on top would launch two."""
    return role not in (MemberRole.SCALE_UP, MemberRole.SUCCESSOR)


# ------------------------------------------------------------------ walltime
#
# A member's successor is launched `lead` before its job's time limit (Slurm's EndTime):
#
#     lead = queue + HANDOVER_STARTUP_FACTOR x startup + HANDOVER_MARGIN_S   (at least serve.handover_s;
#                                                       planning.walltime: the same lead refuses walltimes)
#
#     queue    the wait Slurm expects for the successor now (sbatch --test-only), refreshed every minute
#     startup  job start -> serving, the longest of the last STARTUPS_CONSIDERED members measured while
#              the endpoint served requests; before any was, the idle ones' x IDLE_TO_LOADED
#
# Handovers follow one another (at most one successor starting at a time: a second one would compete for
# the same free nodes and double the capacity at risk), planned backwards from the last job to end; a
# member whose own lead has come is handed over even while another handover runs. The old member serves
# until its successor serves, or until END_DRAIN_S before its job ends: then it is drained so that the
# requests it runs finish before Slurm's TERM, and the data plane holds new ones (serve.hold_s) until
# the successor joins, when it was the last replica.

STARTUPS_CONSIDERED = 3
IDLE_TO_LOADED = 2.0
END_DRAIN_S = 20.0


@dataclass(frozen=True)
class Startup:
    """One member's measured start: its job's start to serving (the queue before it is not in it)."""

    member: str
    seconds: float
    under_load: bool  # the endpoint served requests while it started


@dataclass(frozen=True)
class Estimate:
    seconds: float
    basis: str  # where the figure comes from, for the decision's reason


def expected_startup(recent: list[Startup], fallback: Estimate) -> Estimate:
    """recent: oldest first. The first members start on an idle endpoint, and a successor starts next to
    a serving replica under load: measured on the sandbox's shared cores, 50 s idle against 212 s under
    load, so idle measurements count only until one under load exists."""
    loaded = [s for s in recent if s.under_load][-STARTUPS_CONSIDERED:]
    if loaded:
        worst = max(s.seconds for s in loaded)
        return Estimate(worst, "measured under load: " + ", ".join(f"{s.member} {s.seconds:.0f} s" for s in loaded))
    idle = recent[-STARTUPS_CONSIDERED:]
    if idle:
        worst = max(s.seconds for s in idle)
        return Estimate(IDLE_TO_LOADED * worst, f"none measured under load yet: {IDLE_TO_LOADED:g} x the idle "
                        + ", ".join(f"{s.member} {s.seconds:.0f} s" for s in idle))
    return fallback


def queue_estimate(expected_start: float | None, now: float, asked_at: str) -> Estimate:
    """Slurm's expected start of a job submitted now (None: it gave none) as a wait from now."""
    if expected_start is None:
        return Estimate(0.0, "Slurm gave no estimate")
    wait = max(0.0, expected_start - now)
    return Estimate(wait, f"sbatch --test-only at {asked_at}")


@dataclass(frozen=True)
class Lead:
    """How long before a job's end its successor is launched, and from what."""

    queue: Estimate
    startup: Estimate
    configured_s: float | None = None  # serve.handover_s: a lower bound

    @property
    def computed_s(self) -> float:
        return handover_lead_s(self.queue.seconds, self.startup.seconds)

    @property
    def seconds(self) -> float:
        return max(self.computed_s, self.configured_s or 0.0)

    @property
    def expected_s(self) -> float:
        """Launch to serving, as expected (without the safety factor and margin)."""
        return self.queue.seconds + self.startup.seconds

    def describe(self) -> str:
        text = (f"lead {self.seconds:.0f} s = queue {self.queue.seconds:.0f} s ({self.queue.basis}) + "
                f"{HANDOVER_STARTUP_FACTOR:g} x startup {self.startup.seconds:.0f} s ({self.startup.basis}) + "
                f"{HANDOVER_MARGIN_S:.0f} s")
        if self.configured_s and self.configured_s > self.computed_s:
            text = f"lead {self.seconds:.0f} s (serve.handover_s; computed: {text.removeprefix('lead ')})"
        return text


@dataclass(frozen=True)
class Ending:
    """A serving member without a successor yet, whose job has a time limit."""

    member: str
    ends: float  # epoch seconds (Slurm's EndTime)
    lead_s: float  # its successor is launched at the latest this long before it ends
    span_s: float  # launch to serving, as expected (queue and startup, without the lead's margins)


def handover_starts(endings: list[Ending]) -> dict[str, float]:
    """When each member's successor should be launched: its lead before its job ends, or earlier so that
    its handover is expected to be done when the next one starts (planned backwards from the last job to
    end). Jobs started together end together: the first is then handed over one span before the other."""
    starts: dict[str, float] = {}
    following = math.inf
    for ending in sorted(endings, key=lambda e: (e.ends, e.member), reverse=True):
        starts[ending.member] = min(ending.ends - ending.lead_s, following - ending.span_s)
        following = starts[ending.member]
    return starts


@dataclass(frozen=True)
class HandoverCall:
    member: str
    left_s: float  # the time its job really has left now
    reason: str


def handovers_due(endings: list[Ending], in_handover: list[str], now: float) -> list[HandoverCall]:
    """The members whose successors are launched now. in_handover: members whose successor is starting."""
    starts = handover_starts(endings)
    busy = list(in_handover)
    calls = []
    for ending in sorted(endings, key=lambda e: (e.ends, e.member)):
        if now < starts[ending.member]:
            continue
        left = ending.ends - now
        overdue = left <= ending.lead_s
        if busy and not overdue:
            continue  # its turn comes when the running handover is done
        if busy:
            reason = f"its lead has come although {', '.join(busy)} is still in handover"
        elif overdue:
            reason = f"its job ends in {left:.0f} s (at most its lead)"
        else:
            reason = (f"its job ends in {left:.0f} s; handed over early, so that the handovers after it "
                      "follow one at a time")
        calls.append(HandoverCall(ending.member, left, reason))
        busy.append(ending.member)
    return calls


def projected_join(pending: bool, start: float | None, startup_s: float, now: float) -> float | None:
    """When a starting successor should serve. pending: start is Slurm's expected start (None: no estimate
    yet); running: start is its job's start."""
    if start is None:
        return None
    if pending:
        return max(now, start) + startup_s
    return max(now, start + startup_s)


def end_drain_due(ends: float, now: float) -> bool:
    """The old member stops taking requests this long before its job ends (Slurm's TERM cuts what runs)."""
    return ends - now <= END_DRAIN_S


def served_during(history: list[LoadSample], since: float) -> bool:
    """Did the endpoint serve requests since `since` (a member's start under load)?"""
    return any(sum(s.running.values()) + sum(s.waiting.values()) > 0 for s in history if s.time >= since)


# ------------------------------------------------------------------ adoption

def adopt_member(status: MemberStatus, gone: str | None, probe_error: str | None) -> tuple[Adoption, str]:
    """What a new controller does with a member as its lost predecessor recorded it. gone: why its job or
    driver can no longer serve (checked now), None while it runs; probe_error: why a real completion to
    one of its replicas failed (asked only of serving members whose job runs), None when all answered.
    No running replica is restarted: only one that fails a real completion is replaced."""
    if status in (MemberStatus.GONE, MemberStatus.FAILED):
        return Adoption.KEEP, ""
    if status is MemberStatus.LAUNCHING:  # its start watch tells whether it joins or failed meanwhile
        return Adoption.WATCH, "still starting: watched as before"
    if gone:
        if status is MemberStatus.SERVING:
            return Adoption.LOST, f"lost while no controller ran: {gone}"
        return Adoption.FINISH, f"was {status}; {gone}"
    if status is MemberStatus.SERVING:
        if probe_error:
            return Adoption.DROP, f"its job runs, but a real completion failed: {probe_error}"
        return Adoption.ADOPT, "its job runs and every replica answered a real completion"
    return Adoption.FINISH, f"was {status}: finished now"


def backend_changes(in_router: list[str], wanted: list[str]) -> tuple[list[str], list[str]]:
    """(to remove, to add): while adopting, the controller owns the router's backend list, so a backend
    it did not put there (or no longer wants) leaves, and every one it wants is there."""
    have, want = {u.rstrip("/") for u in in_router}, {u.rstrip("/") for u in wanted}
    return sorted(have - want), sorted(want - have)


# ------------------------------------------------------------------ burst (preemptible partitions)
#
# autoscale.burst adds replicas on a preemptible partition: beyond autoscale.max on the main one (or before
# it, burst.first). Slurm may take such a job's nodes back at any time: with --signal=B:USR1@N (and the
# site's preempt_send_user_signal) the member gets USR1 at once, writes a notice, and the controller drains
# it (its streams move to the others) within the partition's GraceTime, then asks for a replacement.


@dataclass(frozen=True)
class Placement:
    """Where one more replica goes, and why (for the decision log)."""

    burst: bool
    reason: str


def place_replica(spec: AutoscaleSpec, base: int, burst: int, replacing_preempted: bool = False) -> Placement | None:
    """base, burst: replicas serving or starting on the main partition and on the burst one. A scale-up goes
    to the main partition while it is below autoscale.max (the burst one first with burst.first); a
    preempted replica's replacement to the main partition where there is room, else to the burst one again.
    None: no room on either. Pure."""
    extra = spec.burst
    main_room, burst_room = base < spec.max, extra is not None and burst < extra.max
    if extra is not None and extra.first and burst_room and not replacing_preempted:
        return Placement(True, f"on burst partition {extra.partition} first (autoscale.burst.first; "
                         f"{burst}/{extra.max} there)")
    if main_room:
        return Placement(False, f"on the main partition ({base}/{spec.max} there"
                         + (", room before the burst partition)" if extra is not None else ")"))
    if burst_room and extra is not None:
        return Placement(True, f"on burst partition {extra.partition}: the main partition is at autoscale.max "
                         f"{spec.max} ({burst}/{extra.max} burst replicas)")
    return None


def decide_preemption(member: str, notice: dict | None, job: JobInfo | None, now: float) -> ScaleDecision:
    """A burst member's job got its --signal (notice: {"signal", "time"} from the member; None: its job's end
    came due before the signal was seen). "preempted" when Slurm set the job's PreemptTime (or does not show
    the job), "job ending" when the signal came ahead of its time limit (the walltime, not a preemption: no
    replacement here, the handover has one). Either way the member is drained at once: Slurm ends the job
    soon. Pure."""
    if notice is None:
        signalled = f"{member}'s job end came within {END_DRAIN_S:.0f} s, its signal not seen yet"
    else:
        signalled = (f"{member} got {notice.get('signal', 'a signal')} "
                     f"{now - float(notice.get('time') or now):.0f} s ago")
    if job is None:
        return ScaleDecision("preempted", f"{signalled}; Slurm no longer shows its job: taken as preempted, "
                             "drained at once")
    ends = slurm_epoch(job.end_time)
    left = f", {ends - now:.0f} s left before Slurm ends it" if ends is not None else ""
    if job.preempt_time is not None:
        return ScaleDecision("preempted", f"{signalled}: job {job.job_id} preempted by Slurm at {job.preempt_time}"
                             f"{left} (the partition's GraceTime): drained at once, its streams move to the others")
    return ScaleDecision("job ending", f"{signalled}: job {job.job_id} not preempted (no PreemptTime), its time "
                         f"limit is near{left}: drained at once")


# ---------------------------------------------------------------- swap: several models on one member's GPUs

@dataclass(frozen=True)
class ModelUse:
    """One model's engine on one member, as the swap sees it this round."""

    name: str
    awake: bool
    waiting: int  # its requests the data plane holds now (no awake engine takes them)
    in_flight: int  # its requests running on this member's engine (the data plane's count)
    awake_since: float | None  # epoch seconds; None while asleep
    last_used: float  # epoch seconds: the last time a request of it ran or waited (its wake, at first)


@dataclass(frozen=True)
class SwapDecision:
    """wake: the model woken; sleep: the one put to sleep first (out of its room, then POST /sleep)."""

    action: Literal["wake", "swap", "hold", "none"]
    reason: str
    wake: str | None = None
    sleep: str | None = None


def decide_swap(models: list[ModelUse], awake_at_most: int, min_awake_s: float, now: float) -> SwapDecision:
    """Which model of one member's GPUs wakes, and which sleeps for it. A model with requests waiting and no
    awake engine wakes (the one with most waiting first); with swap.awake models already awake, the least
    recently used one that has nothing in flight or waiting and has been awake min_awake_s is put to sleep
    first; when none may go yet, the request waits (hold, with why). Pure."""
    wanted = sorted((m for m in models if not m.awake and m.waiting), key=lambda m: (-m.waiting, m.name))
    if not wanted:
        return SwapDecision("none", "no request waits for a sleeping model")
    wake = wanted[0]
    awake = [m for m in models if m.awake]
    asked = f"{wake.name}: {wake.waiting} request(s) waiting, asleep"
    if len(awake) < awake_at_most:
        return SwapDecision("wake", f"{asked}; {len(awake)} of swap.awake {awake_at_most} awake: room to wake it",
                            wake=wake.name)
    free = [m for m in awake if not m.in_flight and not m.waiting
            and m.awake_since is not None and now - m.awake_since >= min_awake_s]
    if not free:
        return SwapDecision("hold", f"{asked}; every awake model is busy or woke less than swap.min_awake_s "
                            f"{min_awake_s:g} s ago ({', '.join(busy_reason(m, now) for m in awake)}): it waits",
                            wake=wake.name)
    sleep = min(free, key=lambda m: (m.last_used, m.name))
    return SwapDecision("swap", f"{asked}; {sleep.name} least recently used (last request {now - sleep.last_used:.0f} "
                        f"s ago), nothing in flight, awake {now - (sleep.awake_since or now):.0f} s (>= "
                        f"swap.min_awake_s {min_awake_s:g} s): {sleep.name} sleeps, {wake.name} wakes",
                        wake=wake.name, sleep=sleep.name)


def busy_reason(model: ModelUse, now: float) -> str:
    """Why an awake model may not be put to sleep now, e.g. "llama: 2 in flight". Pure."""
    if model.in_flight or model.waiting:
        return f"{model.name}: {model.in_flight} in flight, {model.waiting} waiting"
    return f"{model.name}: awake {now - (model.awake_since or now):.0f} s"
