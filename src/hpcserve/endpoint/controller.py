"""The endpoint's control plane: one tick a second over the router and the members behind it.

    probe each replica (leave the pool after failed probes); load-aware rotation (balance); replace
    lost members; scale with the queue (autoscale); hand over before a job's time limit

Every decision and its reason goes to state.json (`hpcserve status` shows them). The decisions
themselves are pure functions in endpoint/decisions.py; the process around this is endpoint/process.py.
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

from hpcserve.core.config import DeploymentConfig, Layout
from hpcserve.deployment.driver import Stop
from hpcserve.endpoint.decisions import (LoadSample, ProbeResult, decide_scale, handover_due, handover_lead_s,
                                        replace_failed_launch, should_leave, update_idle_since)
from hpcserve.endpoint.members import (Member, described_replicas, free_slot, member_config, replica_urls,
                                      single_replica)
from hpcserve.deployment.runs import job_info, launch, queue_line, runner_gone, stop
from hpcserve.endpoint.router import EngineLoad, Rotation, engine_load, is_drained
from hpcserve.engine.client import auth_headers, completion_probe
from hpcserve.core.timeline import Progress

TICK_S = 1.0
ROTATION_S = 0.2  # the load-aware rotation between ticks (measured: docs/benchmarks/router.md)
PROBE_TIMEOUT_S = 1.0
DRAIN_TIMEOUT_S = 120.0
MAX_FAILED_LAUNCHES = 3  # members in a row that never became ready: stop replacing, say why
JOB_CHECK_EVERY_S = 5.0
FORWARDED_STAGES = ("ray", "health", "engine")  # the first member's stages appear in the endpoint's timeline


class Endpoint:
    def __init__(self, cfg: DeploymentConfig, run_dir: Path, router, api_key: str | None):
        self.cfg, self.run_dir, self.router, self.api_key = cfg, run_dir, router, api_key
        self.progress = Progress(run_dir)
        self.members: list[Member] = []
        self.probes: dict[str, list[ProbeResult]] = {}
        self.history: list[LoadSample] = []
        self.idle_since: dict[str, float] = {}
        self.decisions: list[dict] = []
        self.failed_launches = 0
        self.forwarded = 0
        self.last_job_check = 0.0
        self.last_member_check: dict[str, float] = {}  # launching member -> when Slurm was last asked
        self.client = httpx.Client(timeout=PROBE_TIMEOUT_S, trust_env=False)
        self.ready = False
        self.loads: dict[str, EngineLoad] = {}  # each backend's last /metrics figures
        self.rotation = Rotation(router)  # load-aware: who of the pool takes new requests now
        self.stop_requested: str | None = None  # a signal's name; the loop stops between steps, never in one

    # ------------------------------------------------------------ members
    def launch(self, role: str, layout: Layout, replaces: str | None = None, group: int = 0) -> Member:
        slot = free_slot(self.members)
        name = f"{self.cfg.name}-m{len(self.members)}"
        member_cfg = member_config(self.cfg, name, slot, layout, self.run_dir / "members", group)
        (self.run_dir / "members" / "logs").mkdir(parents=True, exist_ok=True)
        key_env = {self.cfg.serve.api_key_env: self.api_key} if self.cfg.serve.api_key_env and self.api_key else {}
        record = launch(member_cfg, self.run_dir / "members", key_env)
        member = Member(name, slot, role, layout.model_dump(), record.__dict__, replaces=replaces, group=group)
        self.members.append(member)
        self.decide(f"launch {role}", f"{name} ({record.job_id and 'job ' + record.job_id or 'local driver'})"
                    + (f", replacing {replaces}" if replaces else ""))
        return member

    def stop_member(self, member: Member, why: str) -> None:
        """Stop in the background: a job's orderly stop takes seconds, the loop must keep probing."""
        member.status, member.note = "stopping", why
        for url in member.backends:
            self.leave(url, why)

        def run() -> None:
            try:
                stop(member.as_record(), timeout_s=60)
            finally:
                member.status = "gone"

        threading.Thread(target=run, name=f"stop-{member.name}", daemon=True).start()

    def live(self) -> list[Member]:
        return [m for m in self.members if m.status in ("launching", "serving", "draining")]

    # ------------------------------------------------------------ pool
    def join(self, member: Member) -> None:
        """The member's replicas answered a real completion (its driver checked): probe them once more
        from here (the router's side of the network), then give them traffic."""
        urls = replica_urls(member.state())
        for url in urls:
            completion_probe(url, self.cfg.model.name, self.api_key, timeout_s=60)
        for url in urls:
            self.router.add(url)
            self.probes[url] = []
        member.backends, member.status, member.note = urls, "serving", ""
        member.ready_s = time.time() - member.launched
        self.decide("join", f"{member.name}: {', '.join(urls)} in the pool after {member.ready_s:.0f} s")
        self.failed_launches = 0

    def leave(self, url: str, why: str) -> None:
        """Out of the pool for good (a paused backend is out of the router already, but still counted)."""
        if url in (b.url for b in self.router.backends()):
            self.router.remove(url, drain_s=0)  # the controller waits for the drain itself, not blocking
        self.decide("leave", f"{url}: {why}")
        self.rotation.paused.discard(url)
        self.probes.pop(url, None)
        self.idle_since.pop(url, None)
        self.loads.pop(url, None)

    def balance(self) -> None:
        """Load-aware routing the data plane cannot do (it does not read vLLM's /metrics): a backend whose
        engine queues requests or whose KV cache is nearly full is out of rotation while another has room.
        Each tick with the probes' figures; between ticks with fresh ones (rotate)."""
        self.rotation.update(self.pool(), self.answering(), self.loads)

    def rotate(self) -> None:
        """Between ticks, every ROTATION_S: the answering backends' load again, and the rotation updated.
        A slow replica then gets new requests about as fast as it finishes them (docs/endpoint.md)."""
        answering = self.answering()
        for url in answering:
            load = self.router.engine_load(url, timeout_s=ROTATION_S)
            if load is not None:
                self.loads[url] = load
        self.rotation.update(self.pool(), answering, self.loads)

    def answering(self) -> set[str]:
        """The pool's backends whose last probe passed."""
        return {u for u in self.pool() if self.probes.get(u) and self.probes[u][-1].ok}

    def pool(self) -> list[str]:
        return [u for m in self.members if m.status == "serving" for u in m.backends]

    # ------------------------------------------------------------ one tick
    def tick(self) -> None:
        """One round. A step that fails (a Slurm command timing out, the router refusing a change) is
        reported as a decision and tried again next round: the endpoint keeps serving meanwhile."""
        steps = [self.forward_first_member, self.keep_router_up, self.check_members, self.check_jobs, self.balance]
        if self.ready:
            steps += [self.scale, self.hand_over, self.keep_count]
        for step in steps:
            if self.stop_requested:
                raise Stop(self.stop_requested)
            try:
                step()
            except MemberFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - see the docstring
                self.decide("error", f"{step.__name__}: {type(exc).__name__}: {exc}"[:400])
        self.save()

    def rotate_until(self, deadline: float) -> None:
        """The time between two ticks: the load-aware rotation, every ROTATION_S."""
        while not self.stop_requested and time.monotonic() + ROTATION_S < deadline:
            time.sleep(ROTATION_S)
            try:
                self.rotate()
            except Exception as exc:  # noqa: BLE001 - as in tick: reported, tried again
                self.decide("error", f"rotate: {type(exc).__name__}: {exc}"[:400])
        time.sleep(max(0.0, deadline - time.monotonic()))

    def request_stop(self, signum: int, _frame) -> None:
        """Signal handler: note it; the loop stops at the next step (no exception in the middle of one)."""
        self.stop_requested = signal.Signals(signum).name
        print(f"[endpoint] stop requested ({self.stop_requested}) by signal", flush=True)

    def keep_router_up(self) -> None:
        if not self.router.alive():  # the data plane died: same port, same pool, at once
            self.router.stop()
            self.router.start([u for u in self.pool() if u not in self.rotation.paused])
            self.decide("router restarted", f"the router process had exited; see {self.router.log_path}")

    def check_members(self) -> None:
        for member in list(self.members):
            if member.status == "launching":
                self.check_launching(member)
            elif member.status in ("serving", "draining"):
                self.check_serving(member)

    def check_launching(self, member: Member) -> None:
        state = member.state()
        if state.get("status") == "ready":
            try:
                self.join(member)
            except Exception as exc:  # noqa: BLE001 - reported; the member is replaced below
                self.launch_failed(member, {"stage": "router", "diagnosis": f"probe from the endpoint failed: {exc}",
                                            "log": None})
            return
        gone = None
        if state.get("status") not in ("failed", "stopped") and self.job_check_due(member):
            self.note_queue(member)
            gone = runner_gone(member.as_record())
        if state.get("status") in ("failed", "stopped") or gone:
            error = state.get("error") or {"stage": state.get("stage", "submitted"), "diagnosis": gone or "stopped",
                                           "log": str(member.run_dir)}
            self.launch_failed(member, error)

    def job_check_due(self, member: Member) -> bool:
        """Ask Slurm about a member at most every JOB_CHECK_EVERY_S: sites rate-limit squeue, and the
        member's own state file (read every round) tells most of it."""
        now = time.monotonic()
        if now - self.last_member_check.get(member.name, 0.0) < JOB_CHECK_EVERY_S:
            return False
        self.last_member_check[member.name] = now
        return True

    def note_queue(self, member: Member) -> None:
        """A member's job waiting in Slurm's queue: its reason in the member's line of `status` and, for the
        endpoint's first member, in the timeline `up` follows (users otherwise stare at nothing)."""
        record = member.as_record()
        if not record.job_id or member.timeline():  # started: its own stages tell the rest
            return
        line = queue_line(record)
        if line is None or line == member.note:
            return
        member.note = line
        if member is self.members[0] and not self.ready and line.startswith("PENDING"):
            self.progress.add({"stage": "queue", "event": "waiting", "time": time.time(),
                               "detail": f"{member.name} (job {record.job_id}): {line}"})

    def launch_failed(self, member: Member, error: dict) -> None:
        member.error = error
        member.retired = not replace_failed_launch(member.role)
        self.decide("launch failed", f"{member.name} at stage '{error.get('stage')}': {error.get('diagnosis')}"[:400])
        self.stop_member(member, f"failed at stage '{error.get('stage')}': {error.get('diagnosis')}")
        member.status = "failed"
        self.failed_launches += 1
        if not self.ready:
            raise MemberFailed(error)

    def check_serving(self, member: Member) -> None:
        for url in list(member.backends):
            result = self.probe(url)
            self.probes.setdefault(url, []).append(result)
            del self.probes[url][:-10]
            if should_leave(self.probes[url]):
                self.stop_member(member, f"{url} failed {len(self.probes[url][-2:])} probes: {result.detail}")
                return

    def probe(self, url: str) -> ProbeResult:
        """/metrics (the API process answers) and /health (vLLM: the engine core is alive); the load
        figures feed the autoscaler. The real completion was sent when the replica joined."""
        try:
            health = self.client.get(f"{url}/health")
            metrics = self.client.get(f"{url}/metrics", headers=auth_headers(self.api_key))
        except httpx.HTTPError as exc:
            return ProbeResult(False, f"{type(exc).__name__}: {exc}"[:200])
        if health.status_code != 200 or metrics.status_code != 200:
            return ProbeResult(False, f"/health {health.status_code}, /metrics {metrics.status_code}")
        try:
            load = self.loads[url] = engine_load(metrics.text)
        except ValueError as exc:
            return ProbeResult(False, f"/metrics is not Prometheus text: {exc}")
        self.record_load(url, load)
        return ProbeResult(True)

    def record_load(self, url: str, load: EngineLoad) -> None:
        now = time.time()
        if not self.history or now - self.history[-1].time > TICK_S / 2:
            self.history.append(LoadSample(now, {}, {}))
        self.history[-1].waiting[url] = load.waiting
        self.history[-1].running[url] = load.running
        if load.finished is not None:
            self.history[-1].finished[url] = load.finished
        del self.history[:-600]

    def check_jobs(self) -> None:
        """A member whose job or driver ended (time limit, node failure, engine crash) leaves at once."""
        if time.monotonic() - self.last_job_check < JOB_CHECK_EVERY_S:
            return
        self.last_job_check = time.monotonic()
        for member in self.members:
            if member.status not in ("serving", "draining"):
                continue
            record = member.as_record()
            info = job_info(record) if record.job_id else None
            member.end_time = info.end_time if info else None
            gone = runner_gone(record)
            if gone:
                self.stop_member(member, gone)

    # ------------------------------------------------------------ policies
    def keep_count(self) -> None:
        """Self-healing: a member that was lost (not drained on purpose) gets a replacement."""
        for member in self.members:
            if member.status in ("stopping", "gone", "failed") and not member.retired and not member.successor:
                if self.failed_launches >= MAX_FAILED_LAUNCHES:
                    member.successor = "none"
                    self.decide("give up", f"{self.failed_launches} launches in a row never became ready: "
                                f"not replacing {member.name}; see its error in `hpcserve status`")
                    continue
                successor = self.launch("replacement", Layout(**member.layout), member.name, member.group)
                member.successor = successor.name

    def scale(self) -> None:
        spec = self.cfg.autoscale
        if spec is None or not self.history:
            return
        self.idle_since = update_idle_since(self.idle_since, self.history[-1],
                                            self.history[-2] if len(self.history) > 1 else None)
        starting = sum(1 for m in self.members if m.status == "launching")
        decision = decide_scale(spec, self.history, len(self.pool()), starting, self.idle_since, time.time())
        if decision.action == "up" and self.failed_launches >= MAX_FAILED_LAUNCHES:
            # No launch loop on a site where members cannot start: say it once, until one joins again.
            if not any(d["action"] == "scale up held" for d in self.decisions[-20:]):
                self.decide("scale up held", f"{decision.reason}, but the last {self.failed_launches} launches "
                            "never became ready; see their errors in `hpcserve status`")
            return
        if decision.action == "up":
            self.decide("scale up", decision.reason)
            self.launch("scale-up", single_replica(self.base_layout()))
            self.history.clear()  # judge the next step on the load the new replica sees
        elif decision.action == "down" and decision.backend:
            self.decide("scale down", decision.reason)
            self.drain(decision.backend, f"drained: {decision.reason}")

    def drain(self, url: str, why: str) -> None:
        """No new requests to the backend; its member stops once nothing runs on it (no request cut)."""
        member = next(m for m in self.members if url in m.backends)
        self.leave(url, why)
        member.backends.remove(url)
        member.status, member.note, member.retired = "draining", why, True
        threading.Thread(target=self._stop_when_idle, args=(member, [url], why), daemon=True).start()

    def _stop_when_idle(self, member: Member, urls: list[str], why: str) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline and any(self._busy(u) for u in urls):
            time.sleep(0.5)
        if not member.backends:
            self.stop_member(member, why)
            member.note = why

    def _busy(self, url: str) -> bool:
        load = self.router.engine_load(url)
        return load is not None and not is_drained(load)  # a dead engine has nothing left to drain

    def hand_over(self) -> None:
        """Before a job's time limit: its successor first, then drain it once the successor serves."""
        if self.cfg.cluster.scheduler != "slurm":
            return
        for member in self.members:
            if member.status != "serving":
                continue
            if member.successor:
                successor = next(m for m in self.members if m.name == member.successor)
                if successor.status == "serving":
                    for url in list(member.backends):
                        self.drain(url, f"handed over to {successor.name}")
                elif successor.status in ("stopping", "gone", "failed"):
                    member.successor = None  # that one never served: start another next round
                continue
            lead = handover_lead_s(member.ready_s, self.cfg.serve.handover_s)
            if handover_due(member.end_time, datetime.now(), lead):
                successor = self.launch("successor", Layout(**member.layout), member.name, member.group)
                member.successor = successor.name
                self.decide("hand over", f"{member.name} ends at {member.end_time}: successor {successor.name} "
                            f"started {lead:.0f} s ahead")

    def base_layout(self) -> Layout:
        first = self.members[0]
        return Layout(**first.layout)

    # ------------------------------------------------------------ state
    def decide(self, action: str, reason: str) -> None:
        self.decisions.append({"time": time.time(), "action": action, "reason": reason})
        del self.decisions[:-100]
        print(f"[endpoint] {action}: {reason}", flush=True)

    def forward_first_member(self) -> None:
        """`up` follows the endpoint's timeline: show the first member's stages in it as they happen."""
        if not self.members or self.ready:
            return
        events = [e for e in self.members[0].timeline() if e["stage"] in FORWARDED_STAGES]
        for event in events[self.forwarded:]:
            self.progress.add(event)
            self.progress.update(stage=event["stage"])
        self.forwarded = len(events)

    def save(self) -> None:
        self.progress.update(replicas=described_replicas(self.members, self.cfg.model.name),
                             paused=sorted(self.rotation.paused), endpoint={"url": self.router.url, "pid": self.router.pid},
                             members=[m.to_json() for m in self.members], decisions=self.decisions[-20:])


class MemberFailed(Exception):
    def __init__(self, error: dict):
        super().__init__(error.get("diagnosis"))
        self.error = error
