"""Several models on one member's GPUs (swap): every member runs one engine per model, the first model's
awake and the swap models' asleep (vLLM's sleep mode); the ones in demand are awake, swapped by demand.

    rooms    every swap model has its room in the endpoint's data plane (PUT /models/NAME, as a joined
             model's), made again when the data plane was restarted; each room is told its model's wake
             (PUT /waking: asleep, starting, serving), so that a request for a sleeping model is held there
             (up to swap.wake_wait_s, SSE comments to a stream) and counted for GET /waking
    demand   each round, and at once when a request is held (a long poll of GET /waking per model): the
             requests held per model, the requests in flight on each engine (GET /backends)
    decide   per member, decisions.decide_swap (pure): wake a model with requests waiting, after putting
             the least recently used idle one to sleep when swap.awake are awake already
    swap     in a thread of its own (sleeping and waking take seconds on a GPU): the sleeping model out of
             its room first (its new requests are held), its requests finished, POST /sleep, then the other's
             POST /wake_up, a real completion, and it joins its room. The first model's engine leaves and
             joins the controller's pool as any replica; the others' their rooms
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from hpcserve.core.config import DeploymentConfig, SwapSpec
from hpcserve.core.statuses import MemberStatus
from hpcserve.endpoint.control.decisions import ModelUse, SwapDecision, decide_swap
from hpcserve.endpoint.control.members import Member, member_capacity
from hpcserve.endpoint.control.plane_client import Router, RouterError
from hpcserve.endpoint.control.policies.base import ControlPlane
from hpcserve.endpoint.protocol import Backends, WakePhase, Waking
from hpcserve.engine.client import completion_probe, engine_sleep, engine_wake_up

log = logging.getLogger(__name__)

LISTEN_S = 10.0  # one GET /waking long poll waits this long for a request
RETRY_S = 1.0  # after the data plane did not answer
FINISH_TIMEOUT_S = 120.0  # the model put to sleep: its requests finish first, up to this long
JOIN_TIMEOUT_S = 60.0  # the woken engine's real completion


@dataclass
class Engines:
    """One member's engines, by model, and which are awake (since when)."""

    urls: dict[str, str]
    awake: dict[str, float]
    last_used: dict[str, float]
    requests: dict[str, int] = field(default_factory=dict)  # per model: the data plane's count sent, last read
    swapping: SwapDecision | None = None  # a swap running now (its thread)
    started: float = 0.0  # when that swap began


class Swapper:
    name = "swap"

    def __init__(self, cfg: DeploymentConfig, rooms: dict[str, Router]):
        """rooms: each swap model's Router (its room in this endpoint's data plane, endpoint.control.process)."""
        self.spec: SwapSpec | None = cfg.swap
        self.cfg, self.primary, self.rooms = cfg, cfg.model.name, rooms
        self.models = [self.primary, *rooms]
        self.members: dict[str, Engines] = {}
        self.rooms_pid: int | None = None  # the data plane the rooms were made in
        self.told: dict[str, Waking] = {}
        self.asleep_since = dict.fromkeys(rooms, time.time())
        self.held_reason: dict[str, str | None] = {}  # member -> the model its last hold was for (said once)
        self.listeners: list[threading.Thread] = []
        self.closed = threading.Event()

    def router(self, ctl: ControlPlane, model: str) -> Router:
        return ctl.router if model == self.primary else self.rooms[model]

    # ------------------------------------------------------------ each round
    def step(self, ctl: ControlPlane) -> None:
        if self.spec is None:
            return
        self.make_rooms(ctl)
        self.follow_members(ctl)
        self.decide(ctl)

    def make_rooms(self, ctl: ControlPlane) -> None:
        """The swap models' rooms in the data plane, with their awake engines (again after a restart)."""
        if self.rooms_pid == ctl.router.pid:
            return
        for model, room in self.rooms.items():
            room.start(self.awake_urls(model))
        self.rooms_pid, self.told = ctl.router.pid, {}
        if not self.listeners:
            self.listeners = [threading.Thread(target=self.listen, args=(ctl, model), name=f"swap-{model}",
                                               daemon=True) for model in self.models]
            for listener in self.listeners:
                listener.start()

    def follow_members(self, ctl: ControlPlane) -> None:
        """A member that serves is followed from its join (its first model awake, the others asleep); one that
        no longer serves (drained, stopped, lost) is forgotten, its swap models' engines out of their rooms."""
        now = time.time()
        for member in ctl.members:
            if member.status is MemberStatus.SERVING and member.name not in self.members and member.backends:
                started = {e["model"]: e["url"] for e in member.state().swap}
                missing = [m for m in self.rooms if m not in started]
                if missing:
                    ctl.decide("error", f"{member.name} started no engine for swap model(s) {', '.join(missing)}: "
                               "they cannot be woken there")
                self.members[member.name] = Engines({self.primary: member.backends[0], **started},
                                                    {self.primary: now}, dict.fromkeys(self.models, now))
        serving = {m.name for m in ctl.members if m.status is MemberStatus.SERVING}
        for name in [n for n in self.members if n not in serving]:
            engines = self.members.pop(name)
            for model, room in self.rooms.items():
                if model in engines.awake and model in engines.urls:
                    room.apply(remove=[engines.urls[model]])

    def decide(self, ctl: ControlPlane) -> None:
        """Each member's swap decision (decisions.decide_swap) on the demand now, carried out in a thread."""
        if not self.members:
            return
        now = time.time()
        waiting, load = self.demand(ctl)
        busy = {d.wake for e in self.members.values() if (d := e.swapping) is not None and d.wake}
        for name, engines in self.members.items():
            if engines.swapping is not None:
                continue
            self.note_use(engines, load, now)
            # A model awake or waking elsewhere takes its requests there: one member wakes it at a time
            elsewhere = busy | {m for other, e in self.members.items() if other != name for m in e.awake}
            uses = [ModelUse(model, model in engines.awake,
                             0 if model in elsewhere and model not in engines.awake else waiting.get(model, 0),
                             load.get(url, (0, 0))[0], engines.awake.get(model), engines.last_used[model])
                    for model, url in engines.urls.items()]
            decision = decide_swap(uses, self.spec.awake if self.spec else 1,
                                   self.spec.min_awake_s if self.spec else 0.0, now)
            if decision.action == "hold":
                if self.held_reason.get(name) != decision.wake:  # said once while the same model waits
                    ctl.decide("swap held", f"{name}: {decision.reason}")
                    self.held_reason[name] = decision.wake
                continue
            if decision.action == "none" or decision.wake is None:
                continue
            self.held_reason.pop(name, None)
            ctl.decide("swap" if decision.sleep else "swap wake", f"{name}: {decision.reason}")
            engines.swapping, engines.started = decision, now
            busy.add(decision.wake)
            threading.Thread(target=self.swap, args=(ctl, ctl.member(name), engines, decision),
                             name=f"swap-{name}", daemon=True).start()
        self.tell(ctl)

    def demand(self, ctl: ControlPlane) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
        """(model -> its requests held now, engine URL -> (requests in flight, requests sent there)), asked
        of the data plane."""
        waiting: dict[str, int] = {}
        load: dict[str, tuple[int, int]] = {}
        for model in self.models:
            router = self.router(ctl, model)
            waiting[model] = router.wakes().held
            answer = Backends.from_json(router.backends_json())
            for backend in answer.backends:
                load[backend.url] = (answer.in_flight_to(backend.url), backend.requests)
            for retired in answer.retired:  # out of its room, its requests still running
                load.setdefault(retired.url, (retired.in_flight, 0))
        return waiting, load

    def note_use(self, engines: Engines, load: dict[str, tuple[int, int]], now: float) -> None:
        """A model whose engine runs a request, or was sent one since the last look, was used now."""
        for model in engines.awake:
            in_flight, sent = load.get(engines.urls[model], (0, 0))
            if in_flight or sent != engines.requests.get(model, 0):
                engines.last_used[model] = now
            engines.requests[model] = sent

    def listen(self, ctl: ControlPlane, model: str) -> None:
        """A request held for a sleeping model: decided at once, not a round later."""
        asked = -1
        while not self.closed.is_set() and not ctl.stop_requested:
            try:
                wakes = self.router(ctl, model).wakes(asked, LISTEN_S if asked >= 0 else 0.0)
            except RouterError as exc:
                log.debug("GET /waking of %s: %s", model, exc)
                self.closed.wait(RETRY_S)
                continue
            new, asked = asked >= 0 and wakes.asked > asked, wakes.asked
            if new:
                with ctl.lock:
                    try:
                        self.decide(ctl)
                    except (RouterError, OSError) as exc:  # the next round decides again
                        log.debug("swap on a request for %s: %s", model, exc)

    # ------------------------------------------------------------ one swap, in its own thread
    def swap(self, ctl: ControlPlane, member: Member, engines: Engines, decision: SwapDecision) -> None:
        started = time.monotonic()
        asleep_s = 0.0
        try:
            if decision.sleep is not None:
                self.put_to_sleep(ctl, member, engines, decision.sleep)
                asleep_s = time.monotonic() - started
            assert decision.wake is not None, "decide() starts a swap only with a model to wake"
            self.wake_up(ctl, member, engines, decision.wake)
        except Exception as exc:  # noqa: BLE001 - reported; the next round decides again
            with ctl.lock:
                ctl.decide("swap failed", f"{member.name}: {type(exc).__name__}: {exc}"[:400])
                engines.swapping = None
            return
        with ctl.lock:
            engines.swapping = None
            ctl.decide("swapped", f"{member.name}: {decision.wake} serves after {time.monotonic() - started:.2f} s"
                       + (f" ({decision.sleep} asleep after {asleep_s:.2f} s)" if decision.sleep else ""))
            self.tell(ctl)

    def put_to_sleep(self, ctl: ControlPlane, member: Member, engines: Engines, model: str) -> None:
        """Out of its room first (its new requests are held and wake it again later), its requests finished,
        then POST /sleep. An engine that does not sleep goes back into its room."""
        url = engines.urls[model]
        with ctl.lock:
            engines.awake.pop(model, None)
            self.asleep_since[model] = time.time()
            if model == self.primary:
                ctl.leave([(url, f"swap: asleep for another model on {member.name}")])
                member.backends = [u for u in member.backends if u != url]
            else:
                self.rooms[model].apply(remove=[url])
            self.tell(ctl)
        router = self.router(ctl, model)
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while router.busy(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not engine_sleep(url, ctl.pool.api_key):
            self.join(ctl, member, engines, model)
            raise RouterError(f"{model}'s engine at {url} did not sleep (POST /sleep refused): it serves on")

    def wake_up(self, ctl: ControlPlane, member: Member, engines: Engines, model: str) -> None:
        """POST /wake_up, a real completion, then it joins its room."""
        url = engines.urls[model]
        if not engine_wake_up(url, ctl.pool.api_key):
            raise RouterError(f"{model}'s engine at {url} did not wake (POST /wake_up)")
        completion_probe(url, model, ctl.pool.api_key, timeout_s=JOIN_TIMEOUT_S)
        self.join(ctl, member, engines, model)

    def join(self, ctl: ControlPlane, member: Member, engines: Engines, model: str) -> None:
        url = engines.urls[model]
        if model == self.primary:
            failed = ctl.pool.join([url], {url: member_capacity(self.cfg, member.group)})
            if failed:
                raise RouterError(f"{model}'s engine at {url} did not join: {failed[url]}")
        else:
            self.rooms[model].apply(add=[url], capacities={url: member_capacity(self.cfg, member.group)})
        with ctl.lock:
            if model == self.primary:
                member.backends = [url]
            now = time.time()
            engines.awake[model] = engines.last_used[model] = now

    # ------------------------------------------------------------ what the data plane and status are told
    def tell(self, ctl: ControlPlane) -> None:
        """Each model's wake to its room (PUT /waking), when it changed."""
        if self.spec is None or self.rooms_pid is None:
            return
        for model in self.models:
            waking = self.waking(model)
            told = self.told.get(model)
            if told is not None and (told.phase, told.member) == (waking.phase, waking.member):
                continue
            self.router(ctl, model).set_waking(waking)
            self.told[model] = waking

    def waking(self, model: str) -> Waking:
        assert self.spec is not None, "only a deployment with swap tells wakes"
        wait_s = self.spec.wake_wait_s
        awake = next((name for name, e in self.members.items() if model in e.awake), None)
        if awake is not None:
            return Waking(WakePhase.SERVING, self.members[awake].awake[model], wait_s, member=awake)
        waking = next((name for name, e in self.members.items() if e.swapping and e.swapping.wake == model), None)
        if waking is not None:
            return Waking(WakePhase.STARTING, self.members[waking].started, wait_s, member=waking)
        return Waking(WakePhase.ASLEEP, self.asleep_since.get(model, time.time()), wait_s)

    def awake_urls(self, model: str) -> list[str]:
        return [e.urls[model] for e in self.members.values() if model in e.awake]

    def summary(self) -> dict | None:
        """member -> {"awake": [...], "asleep": [...]} for state.json (`hpcserve status`)."""
        if self.spec is None:
            return None
        return {name: {"awake": sorted(e.awake), "asleep": sorted(m for m in e.urls if m not in e.awake),
                       **({"swapping": {"wake": e.swapping.wake, "sleep": e.swapping.sleep}} if e.swapping else {})}
                for name, e in self.members.items()}

    def close(self) -> None:
        self.closed.set()
        for room in self.rooms.values():
            room.close()

    def forget(self, url: str) -> None:
        pass
