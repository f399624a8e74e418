"""The endpoint's control plane: one round a second over the router and the members behind it.

    members    launch, watch while they start (deployment.watch), join the pool when they serve
    pool       probe each replica, leave after failed probes, load-aware rotation (endpoint.control.pool)
    policies   self-healing (replace the lost), autoscale (queue), walltime handover (time limit), the
               data plane's migrations written down, `down --member` carried out: each a class of its
               own with one step per round

Every decision and its reason goes to state.json (`hpcserve status` shows them). The decisions
themselves are pure functions in endpoint/control/decisions.py; the process around this is endpoint/control/process.py.
Background threads (a member's stop, a drain) change members only under `lock`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

from hpcserve.benchmark.stats import percentile
from hpcserve.core.config import DeploymentConfig, Layout
from hpcserve.core.errors import StageError
from hpcserve.core.keys import handed_on
from hpcserve.core.runstate import Decision, RunState, RunStateWriter, StageFailure
from hpcserve.core.statuses import MemberRole, MemberStatus, RunStatus, Stage
from hpcserve.deployment.process import Stop
from hpcserve.deployment.runs import Launcher, Runs, SlurmRun, expected_start
from hpcserve.deployment.watch import StartWatch
from hpcserve.endpoint.control.decisions import PlaneLoad, leave_reason, replace_failed_launch, served_during
from hpcserve.endpoint.control.members import (
    Member,
    free_slot,
    member_capacity,
    member_config,
    pool_replicas,
    replica_urls,
)
from hpcserve.endpoint.control.plane_client import Router, RouterError
from hpcserve.endpoint.control.policies.base import Policy
from hpcserve.endpoint.control.policies.handover import Handover
from hpcserve.endpoint.control.policies.member_requests import MemberRequests
from hpcserve.endpoint.control.policies.migration_notes import MigrationNotes
from hpcserve.endpoint.control.policies.preemption import Preemption
from hpcserve.endpoint.control.policies.scaling import Autoscaler, SelfHealing
from hpcserve.endpoint.control.policies.sleeping import Sleeper
from hpcserve.endpoint.control.policies.swapping import Swapper
from hpcserve.endpoint.control.pool import ROTATION_S, Pool
from hpcserve.endpoint.protocol import Backends
from hpcserve.slurm.parse import WillRun
from hpcserve.slurm.states import JobInfo

log = logging.getLogger(__name__)

TICK_S = 1.0
JOB_CHECK_EVERY_S = 5.0  # Slurm is asked about a member at most this often: sites rate-limit squeue
MEMBER_STOP_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 120.0  # a drained replica is stopped after this even if requests still run on it
FORWARDED_STAGES = (Stage.RAY, Stage.HEALTH, Stage.ENGINE)  # the first member's stages appear in the endpoint's timeline
DECISIONS_KEPT = 100
# The decisions logged above INFO (the others are the controller's ordinary work).
DECISION_LEVELS = {"error": logging.ERROR, "launch failed": logging.WARNING, "give up": logging.WARNING,
                   "down member": logging.WARNING, "router restarted": logging.WARNING,
                   "successor late": logging.WARNING}
RECENT_ROUNDS = 20  # the last rounds' durations, in state.json as they are
ROUNDS_KEPT = 300  # round durations kept for the round-time figures in state.json (five minutes)


class MemberFailed(StageError):
    """A member failed before the endpoint was ready: `up` fails with its error."""


class Controller:
    def __init__(self, cfg: DeploymentConfig, run_dir: Path, router: Router, api_key: str | None,
                 runs: Launcher | None = None, swap_rooms: dict[str, Router] | None = None):
        """runs: how members are started and found again; by default real deployments (drivers here or
        Slurm jobs, their jobs asked about with one squeue per JOB_CHECK_EVERY_S). swap_rooms: each swap
        model's Router, its room in this data plane (policies.swapping)."""
        self.cfg, self.run_dir, self.router, self.api_key = cfg, run_dir, router, api_key
        self.runs = runs or Runs.default(JOB_CHECK_EVERY_S)
        self.writer = RunStateWriter(run_dir, compact=True)  # the one writer of its state.json and timeline.json
        self.members: list[Member] = []
        self.lock = threading.RLock()
        self.pool = Pool(router, api_key, cfg.model.name, TICK_S, self.serving_backends)
        self.autoscaler = Autoscaler(cfg.autoscale)
        self.sleeper = Sleeper(cfg.autoscale, cfg.engine.sleep_mode != "off")
        self.swapper = Swapper(cfg, swap_rooms or {})
        self.policies: list[Policy] = [SelfHealing(), self.autoscaler, self.sleeper, self.swapper,
                                       Preemption(cfg.autoscale), Handover(cfg), MigrationNotes(),
                                       MemberRequests(run_dir)]
        self.decisions: list[Decision] = []
        self.failed_launches = 0  # members in a row that never became ready
        self.forwarded = 0
        self.last_job_check = 0.0
        self.watches: dict[str, StartWatch] = {}  # launching member -> its start watch
        # Joins run in a thread of their own: vllm-router takes ~60 ms an add, one add at a time, and a
        # round must not wait for 25 of them (the rest of the pool is probed meanwhile)
        self.joiner = ThreadPoolExecutor(1, thread_name_prefix="join")
        self.joining: dict[str, Future] = {}  # member -> its join (done: url -> why it failed)
        self.described: dict[str, list[dict]] = {}  # member -> its replicas as its driver described them
        self.ready = False
        self.stop_requested: str | None = None  # a signal's name; the loop stops between steps, never in one
        self.round_s: deque[float] = deque(maxlen=ROUNDS_KEPT)  # how long each round took
        self.step_s: deque[float] = deque(maxlen=ROUNDS_KEPT)  # each rotation step between rounds
        self.rounds = 0

    # ------------------------------------------------------------ members
    def launch(self, role: MemberRole, layout: Layout, replaces: str | None = None, group: int = 0,
               burst: bool = False) -> Member:
        """burst: on autoscale.burst's preemptible partition."""
        slot = free_slot(self.members)
        name = f"{self.cfg.name}-m{len(self.members)}"
        results = self.run_dir / "members"
        member_cfg = member_config(self.cfg, name, slot, layout, results, group, burst)
        (results / "logs").mkdir(parents=True, exist_ok=True)
        record = self.runs.launch(member_cfg, results, handed_on(self.run_dir, self.api_key), {})  # a 0600 key copy
        member = Member(name, slot, role, layout.model_dump(), record.to_dict(), replaces=replaces, group=group,
                        burst=burst)
        self.members.append(member)
        self.watches[name] = StartWatch(record, check_every_s=JOB_CHECK_EVERY_S, run_of=self.runs.run_of)
        self.decide(f"launch {role}", f"{name} ({record.job_id and 'job ' + record.job_id or 'local driver'})"
                    + (f" on burst partition {member_cfg.cluster.partition}" if burst else "")
                    + (f", replacing {replaces}" if replaces else ""))
        return member

    def stop_member(self, member: Member, why: str) -> None:
        self.stop_members([(member, why)])

    def stop_members(self, stops: list[tuple[Member, str]]) -> None:
        """Stop in the background: a job's orderly stop takes seconds, the loop must keep probing. Their
        replicas leave the router first, all in one change (10 % of 256 replicas lost at once must not
        cost 25 router round trips)."""
        with self.lock:
            for member, why in stops:
                member.status, member.note = MemberStatus.STOPPING, why
            try:
                self.leave([(url, why) for member, why in stops for url in member.backends])
            finally:  # even if the router refused: the members stop (its breaker skips dead backends)
                for member, _ in stops:
                    threading.Thread(target=self._stop, args=(member,), name=f"stop-{member.name}",
                                     daemon=True).start()

    def _stop(self, member: Member) -> None:
        try:
            self.runs.run_of(member.as_record()).stop(timeout_s=MEMBER_STOP_TIMEOUT_S)
        finally:
            with self.lock:
                member.status = MemberStatus.GONE

    def drain(self, url: str, why: str) -> None:
        self.drain_all([(url, why)])

    def drain_all(self, backends: list[tuple[str, str]]) -> None:
        """No new requests to these backends (one router change: a walltime handover may drain dozens
        in one round), their open streams moved to the others (endpoint/dataplane/streams.py); each member stops
        once nothing runs on it (no request cut)."""
        with self.lock:
            self.leave(backends)
            try:
                self.router.hand_over([url for url, _ in backends])
            except RouterError as exc:  # its streams finish where they are: the drain still waits for them
                self.decide("error", f"hand over: {exc}"[:400])
            drained = []
            for url, why in backends:
                member = next(m for m in self.members if url in m.backends)
                member.backends.remove(url)
                member.status, member.note, member.retired = MemberStatus.DRAINING, why, True
                drained.append((member, url, why))
        for member, url, why in drained:
            self.stop_when_idle(member, [url], why)

    def stop_when_idle(self, member: Member, urls: list[str], why: str) -> None:
        """In the background (also for a drain an adopted member was in when its controller was lost)."""
        threading.Thread(target=self._stop_when_idle, args=(member, urls, why), daemon=True).start()

    def _stop_when_idle(self, member: Member, urls: list[str], why: str) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline and any(self.router.busy(u) for u in urls):
            time.sleep(0.5)
        with self.lock:
            if not member.backends:
                self.stop_member(member, why)
                member.note = why

    def live_members(self) -> list[Member]:
        return [m for m in self.members if m.status.live]

    def serving_backends(self) -> list[str]:
        return [u for m in self.members if m.status is MemberStatus.SERVING for u in m.backends]

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def plane_load(self) -> PlaneLoad:
        answer = Backends.from_json(self.router.backends_json())
        in_flight = sum(b.in_flight for b in answer.backends) + sum(b.in_flight for b in answer.retired)
        return PlaneLoad(in_flight, answer.held)

    def plane_queue(self) -> int:
        """The requests the data plane keeps waiting for the model (admission: fair share holds a user's
        excess there), for the autoscaler: asked only when it is on; 0 while the data plane does not answer."""
        if self.cfg.autoscale is None:
            return 0
        try:
            return Backends.from_json(self.router.backends_json()).waiting
        except RouterError as exc:
            log.debug("the data plane's queue is not known this round: %s", exc)
            return 0

    def base_layout(self) -> Layout:
        return Layout(**self.members[0].layout)

    def job_now(self, member: Member) -> JobInfo | None:
        """Its job as Slurm shows it this moment (one scontrol: for a preemption, not for polling)."""
        run = self.runs.run_of(member.as_record())
        return run.info_now() if member.record.get("job_id") and hasattr(run, "info_now") else None

    def placed(self) -> tuple[int, int]:
        """Replicas serving or starting, not drained on purpose: (on the main partition, on the burst one)."""
        live = [m for m in self.members if m.status in (MemberStatus.LAUNCHING, MemberStatus.SERVING)
                and not m.retired]
        return sum(1 for m in live if not m.burst), sum(1 for m in live if m.burst)

    def job(self, member: Member) -> JobInfo | None:
        return self.runs.run_of(member.as_record()).info() if member.record.get("job_id") else None

    def put_to_sleep(self, backend: str, why: str) -> bool:
        return self.sleeper.put_to_sleep(self, backend, why)

    def queue_position(self, member: Member) -> int | None:
        if not member.record.get("job_id"):
            return None
        run = self.runs.run_of(member.as_record())
        return run.queue_position() if isinstance(run, SlurmRun) else None

    def expected_start(self, layout: Layout, group: int) -> WillRun | None:
        name = f"{self.cfg.name}-m{len(self.members)}"  # as the next launch would name it
        return expected_start(member_config(self.cfg, name, free_slot(self.members), layout, self.run_dir / "members",
                                            group), self.run_dir / "members")

    # ------------------------------------------------------------ pool
    def join(self, members: list[Member]) -> None:
        """These members' replicas answered a real completion (their drivers checked): probe them once
        more from here (the router's side of the network), then give them traffic; all of this round's
        at once, in the join thread. Those that joined serve at once; a member whose replica failed
        that probe is a failed launch (replaced), decided by the next round (finish_joins)."""
        states = {m.name: m.state() for m in members}
        self.described.update({name: st.replicas for name, st in states.items()})  # read once, not every save
        future = self.joiner.submit(self._join, members, states)
        for member in members:
            self.joining[member.name], member.note = future, "joining"

    def _join(self, members: list[Member], states: dict[str, RunState]) -> dict[str, str]:
        urls = {m.name: replica_urls(states[m.name]) for m in members}
        capacities = {url: member_capacity(self.cfg, m.group) for m in members for url in urls[m.name]}
        failed = self.pool.join([url for name in urls for url in urls[name]], capacities)
        with self.lock:
            for member in members:
                if member.status is not MemberStatus.LAUNCHING or any(u in failed for u in urls[member.name]):
                    continue
                member.backends, member.status, member.note = urls[member.name], MemberStatus.SERVING, ""
                ready_s, startup_s = self.measure_startup(member, states[member.name].job_started, time.time())
                self.decide("join", f"{member.name}: {', '.join(member.backends)} in the pool after "
                                    f"{ready_s:.0f} s (queue {ready_s - startup_s:.0f} s, "
                                    f"startup {startup_s:.0f} s{' under load' if member.under_load else ''})")
                self.failed_launches = 0
        return failed

    def measure_startup(self, member: Member, job_started: float | None, now: float) -> tuple[float, float]:
        """What the walltime handover plans with: the member's queue wait and startup, and whether the
        endpoint served requests meanwhile (a replica starts slower next to a loaded one). Returns
        (ready_s, startup_s), as set on the member."""
        ready_s = member.ready_s = now - member.launched
        job_started = member.job_started = job_started or member.launched
        startup_s = member.startup_s = now - job_started
        member.under_load = served_during(self.pool.history, job_started)
        return ready_s, startup_s

    def finish_joins(self) -> None:
        """Members whose join failed: out of the pool again, and a failed launch each."""
        for name in [n for n, future in self.joining.items() if future.done()]:
            future, member = self.joining.pop(name), self.member(name)
            try:
                failed = future.result()
            except Exception as exc:  # noqa: BLE001 - the router or the probe broke: the member failed
                failed = {url: f"join: {type(exc).__name__}: {exc}"[:300] for url in replica_urls(member.state())}
            urls = replica_urls(member.state())
            why = next((failed[u] for u in urls if u in failed), None)
            if why and member.status is MemberStatus.LAUNCHING:
                self.pool.leave([u for u in urls if u not in failed])
                self.launch_failed(member, StageFailure(Stage.ROUTER, why))

    def leave(self, backends: list[tuple[str, str]]) -> None:
        """Backends out of the pool, each with its reason, in one router change."""
        self.pool.leave([url for url, _ in backends])
        for url, why in backends:
            self.decide("leave", f"{url}: {why}")
            for policy in self.policies:
                policy.forget(url)

    # ------------------------------------------------------------ one round
    def tick(self) -> None:
        """One round. A step that fails (a Slurm command timing out, the router refusing a change) is
        reported as a decision and tried again next round: the endpoint keeps serving meanwhile."""
        started = time.monotonic()
        steps: list[tuple[str, Callable[[], None]]] = [
            (step.__name__, step) for step in (self.forward_first_member, self.keep_router_up, self.check_members,
                                               self.check_serving, self.check_jobs, self.pool.balance)]
        if self.ready:
            steps += [(policy.name, partial(policy.step, self)) for policy in self.policies]
        for name, step in steps:
            if self.stop_requested:
                raise Stop(self.stop_requested)
            try:
                with self.lock:
                    step()
            except MemberFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - see the docstring
                self.decide("error", f"{name}: {type(exc).__name__}: {exc}"[:400])
        self.save()
        self.round_s.append(time.monotonic() - started)
        self.rounds += 1

    def rotate_until(self, deadline: float) -> None:
        """The time between two rounds: a probing step and the load-aware rotation, every ROTATION_S
        (on a fixed beat: a slow step does not push the next ones back)."""
        next_step = time.monotonic() + ROTATION_S
        while not self.stop_requested and next_step < deadline:
            time.sleep(max(0.0, next_step - time.monotonic()))
            started = time.monotonic()
            try:
                with self.lock:
                    self.pool.rotate()
            except Exception as exc:  # noqa: BLE001 - as in tick: reported, tried again
                self.decide("error", f"rotate: {type(exc).__name__}: {exc}"[:400])
            self.step_s.append(time.monotonic() - started)
            next_step = max(next_step + ROTATION_S, time.monotonic())
        time.sleep(max(0.0, deadline - time.monotonic()))

    def request_stop(self, signum: int, _frame) -> None:
        """Signal handler: note it; the loop stops at the next step (no exception in the middle of one)."""
        self.stop_requested = signal.Signals(signum).name
        log.info("stop requested (%s) by signal", self.stop_requested)

    def keep_router_up(self) -> None:
        if not self.router.alive():  # the data plane died: same port, same pool, at once
            self.router.stop()
            self.router.start(self.pool.in_rotation())
            self.decide("router restarted", f"the router process had exited; see {self.router.log_path}")

    def check_members(self) -> None:
        """Launching members: those that serve now join (together), those that failed are reported."""
        self.finish_joins()
        ready = [m for m in list(self.members) if m.status is MemberStatus.LAUNCHING
                 and m.name not in self.joining and self.check_launching(m)]
        if ready:
            self.join(ready)

    def check_launching(self, member: Member) -> bool:
        """True when the member's driver reports it ready (it joins)."""
        watch = self.watches.setdefault(member.name, StartWatch(member.as_record(), JOB_CHECK_EVERY_S,
                                                                run_of=self.runs.run_of))
        seen = watch.observe()
        if seen.state.status is RunStatus.READY:
            return True
        if seen.queue:
            self.note_queue(member, seen.queue)
        if seen.state.status.ended or seen.gone:
            self.launch_failed(member, seen.state.error or StageFailure(seen.state.stage or Stage.SUBMITTED,
                                                                         seen.gone or RunStatus.STOPPED, str(member.run_dir)))
        return False

    def note_queue(self, member: Member, line: str) -> None:
        """A member's job waiting in Slurm's queue: its reason in the member's line of `status` and, for the
        endpoint's first member, in the timeline `up` follows (users otherwise stare at nothing)."""
        member.note = line
        if member is self.members[0] and not self.ready and line.startswith("PENDING"):
            self.writer.add({"stage": Stage.QUEUE, "event": "waiting", "time": time.time(),
                             "detail": f"{member.name} (job {member.record['job_id']}): {line}"})

    def launch_failed(self, member: Member, error: StageFailure) -> None:
        member.error = error.to_dict()
        member.retired = not replace_failed_launch(member.role)
        self.decide("launch failed", f"{member.name} at stage '{error.stage}': {error.diagnosis}"[:400])
        self.stop_member(member, f"failed at stage '{error.stage}': {error.diagnosis}")
        member.status = MemberStatus.FAILED
        self.failed_launches += 1
        if not self.ready:
            raise MemberFailed(error.stage or Stage.ENGINE, error.diagnosis or RunStatus.FAILED, error.log)

    def check_serving(self) -> None:
        """The probes' results taken in (endpoint.control.pool: every replica is probed once a second, spread
        over the second); a member whose replica failed its probes stops, and self-healing replaces it."""
        self.pool.step()
        self.pool.record_sample(self.plane_queue())
        leaving = set(self.pool.leaving())
        stops = []
        for member in self.members:
            url = next((u for u in member.backends if u in leaving), None)
            if member.status is MemberStatus.SERVING and url:
                stops.append((member, f"{url} {leave_reason(self.pool.probes[url])}"))
        if stops:
            self.stop_members(stops)

    def check_jobs(self) -> None:
        """A member whose job or driver ended (time limit, node failure, engine crash) leaves at once."""
        if time.monotonic() - self.last_job_check < JOB_CHECK_EVERY_S:
            return
        self.last_job_check = time.monotonic()
        for member in self.members:
            if member.status not in (MemberStatus.SERVING, MemberStatus.DRAINING, MemberStatus.SLEEPING):
                continue
            run = self.runs.run_of(member.as_record())
            if member.record.get("job_id"):
                info = run.info()
                member.end_time = info.end_time if info else None
            gone = run.gone()
            if gone:
                self.stop_member(member, gone)

    def close(self) -> None:
        """The threads and connections of the control plane itself (members and router are stopped apart)."""
        self.joiner.shutdown(wait=False, cancel_futures=True)
        self.sleeper.close()
        self.swapper.close()
        self.pool.close()

    # ------------------------------------------------------------ state
    def decide(self, action: str, reason: str) -> None:
        self.decisions.append(Decision(time.time(), action, reason))
        del self.decisions[:-DECISIONS_KEPT]
        log.log(DECISION_LEVELS.get(action, logging.INFO), "%s: %s", action, reason)

    def forward_first_member(self) -> None:
        """`up` follows the endpoint's timeline: show the first member's stages in it as they happen."""
        if not self.members or self.ready:
            return
        events = [e for e in self.members[0].timeline() if e["stage"] in FORWARDED_STAGES]
        for event in events[self.forwarded:]:
            self.writer.add(event)
            self.writer.update(stage=event["stage"])
        self.forwarded = len(events)

    def save(self) -> None:
        with self.lock:
            self.writer.update(replicas=pool_replicas(self.members, self.cfg.model.name, self.described),
                               paused=sorted(self.pool.rotation.paused),
                               endpoint={"url": self.router.url, "pid": self.router.pid},
                               members=[m.to_json() for m in self.members],
                               control={"rounds": self.rounds, **control_figures(list(self.round_s), list(self.step_s),
                                                                                 self.runs.slurm_queries())},
                               autoscale=self.autoscaler.last,
                               sleep=self.sleeper.told_json(),
                               swapped=self.swapper.summary(),
                               decisions=[d.to_dict() for d in self.decisions[-20:]])


def control_figures(round_s: list[float], step_s: list[float], slurm_queries: int | None) -> dict:
    """The control plane's own figures for state.json: round and rotation-step times (ms), the last
    rounds as they were, and the Slurm queries made."""
    return {**percentiles_ms("round", round_s), **percentiles_ms("step", step_s),
            "round_ms_recent": [round(1000 * s, 2) for s in round_s[-RECENT_ROUNDS:]],
            "slurm_queries": slurm_queries}


def percentiles_ms(name: str, durations: list[float]) -> dict:
    """p50, p99 and the maximum in ms (None without durations), computed as the benchmarks compute theirs."""
    def at(q: float) -> float | None:
        value = percentile(durations, q)
        return round(1000 * value, 2) if value is not None else None

    return {f"{name}s_kept": len(durations), f"{name}_ms_p50": at(50), f"{name}_ms_p99": at(99),
            f"{name}_ms_max": at(100)}
