"""The models behind one data plane: one Room each, chosen per request by the model it names.

    rooms = Rooms(Room("qwen", Routing.PREFIX, 60.0, ...))   # its own: the model the command line named
    rooms.add(Room("llama", ...))         # another deployment's model joins
    room = rooms.for_request(data)        # the body's "model"; the only room when there is one
    rooms.remove("llama")                 # its held requests get 404, its running ones finish

A room holds what was the whole data plane's when it served one model: its pool of replicas (routing),
its admission, its tokenizer and KV-event feeds, its held requests' wake-up, its migrations' record. A
stream migrates only among its own room's replicas, since a continuation must run on the same model.
With one room, a request goes there without a look at its body (the hot path pays nothing for models it
does not have); with several, the body's "model" picks the room: a dict lookup.

A room named "" is the data plane of a caller that named no model (tests, benchmarks): every request goes
there and GET /v1/models is the engines' to answer, as before rooms existed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from pathlib import Path

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane import wire
from hpcserve.endpoint.dataplane.admission import Admission, FairShare
from hpcserve.endpoint.dataplane.kv_feed import Feeds
from hpcserve.endpoint.dataplane.routing.prompt_tokens import PromptTokenizer
from hpcserve.endpoint.dataplane.routing.table import RoutingTable
from hpcserve.endpoint.dataplane.waking import Sleep
from hpcserve.endpoint.protocol import Migration, ModelRoom, Models, ModelState, WakePhase

MIGRATION_LOG = 1000  # the last migrations kept per model for GET /migrations
OWNED_BY = "hpcserve"


class Room:
    """One model's share of the data plane: its replicas, how they are chosen, and who waits for them."""

    def __init__(self, name: str, policy: Routing, hold_s: float, admit_kv_share: float, workers: int = 1,
                 fair: FairShare | None = None):
        self.name, self.policy, self.hold_s = name, policy, hold_s
        self.prefix = policy is Routing.PREFIX
        self.pool = RoutingTable()
        self.admission = Admission(self.pool, admit_kv_share if self.prefix else 0.0, workers, fair)
        self.tokenizer: PromptTokenizer | None = None  # with the engines' KV events (kv_feed): exact routing
        self.feeds: Feeds | None = None
        self.changed = asyncio.Event()  # replaced after every membership change: held requests wake
        self.migration_log: deque[Migration] = deque(maxlen=MIGRATION_LOG)
        self.closed = False  # removed: held requests leave with 404, none new comes
        self.held = 0  # its requests held now (what its deployment's `status` calls holding)
        self.sleep = Sleep()  # a model that sleeps when idle (autoscale.min 0): its wake (waking.py)

    def load_tokenizer(self, session, raw_key: str | None, folder: Path | None, template: Path | None) -> str | None:
        """Prompts as the engines' token ids (prefix policy only), and their KV events followed. Returns a
        warning when the folder has no tokenizer (routing by the prompts' text then)."""
        if not (self.prefix and folder):
            return None
        self.tokenizer = PromptTokenizer.load(folder, template)
        if self.tokenizer is None:
            return f"no tokenizer.json in {folder}: model {self.name!r} is routed by prompts' text alone"
        self.feeds = Feeds(session, raw_key, self.pool)
        return None

    def wake(self) -> None:
        """Membership changed: held requests look again, admission recounts its budget."""
        self.changed.set()
        self.changed = asyncio.Event()
        self.admission.admit()

    def state(self, now: float) -> ModelState:
        if any(b.failed_until <= now for b in self.pool.active):
            return ModelState.SERVING
        waking = self.sleep.waking
        if waking is not None and not self.pool.active:
            return ModelState.WAKING if waking.phase in (WakePhase.QUEUED, WakePhase.STARTING) else ModelState.ASLEEP
        return ModelState.STARTING

    def describe(self, now: float, own: bool) -> ModelRoom:
        healthy = sum(1 for b in self.pool.active if b.failed_until <= now)
        return ModelRoom(self.name, self.state(now), len(self.pool.active), healthy, str(self.policy), self.hold_s,
                         own)

    async def close(self) -> None:
        self.closed = True
        self.pool.update([])  # what runs there finishes (retired); nothing new is sent
        self.wake()
        if self.feeds is not None:
            await self.feeds.close()


class NoRoom(Exception):
    """The request names no model this data plane serves: status and OpenAI-style body to answer."""

    def __init__(self, status: int, body: bytes):
        super().__init__(status)
        self.status, self.body = status, body


class Rooms:
    """The data plane's rooms by model name, in join order; the first is its own (it leaves only when the
    data plane stops)."""

    def __init__(self, own: Room) -> None:
        self.own = own
        self.by_name: dict[str, Room] = {own.name: own}
        self.sole: Room | None = own  # the only room, while there is one: requests go there unread

    def add(self, room: Room) -> None:
        self.by_name[room.name] = room
        self._settle()

    def remove(self, name: str) -> Room | None:
        """The room leaves (the own one never does: None)."""
        if name == self.own.name:
            return None
        room = self.by_name.pop(name, None)
        self._settle()
        return room

    def _settle(self) -> None:
        self.sole = next(iter(self.by_name.values())) if len(self.by_name) == 1 else None

    def __iter__(self):
        return iter(list(self.by_name.values()))

    def __len__(self) -> int:
        return len(self.by_name)

    @property
    def named(self) -> bool:
        """Whether the data plane knows its models' names (it answers GET /v1/models itself)."""
        return self.own.name != ""

    def names(self) -> list[str]:
        return list(self.by_name)

    def for_request(self, data: dict | None) -> Room:
        """The room a request of several rooms' data plane goes to, by its body's "model". NoRoom: a body
        without one (400), or a model not served here (404), each naming the models there are."""
        model = data.get("model") if data is not None else None
        if not isinstance(model, str):
            raise NoRoom(400, no_model(self.names()))
        room = self.by_name.get(model)
        if room is None:
            raise NoRoom(404, unknown_model(model, self.names()))
        return room

    def for_url(self, url: str) -> RoutingTable | None:
        """The pool that holds backend url (what a sibling worker's news is about), or None."""
        for room in self.by_name.values():
            if url in room.pool.by_url:
                return room.pool
        return None

    def models(self, now: float) -> Models:
        return Models([room.describe(now, room is self.own) for room in self.by_name.values()])


def models_answer(rooms: Rooms, created: int, now: float, name: str | None = None) -> tuple[int, bytes]:
    """GET /v1/models (or /v1/models/NAME) as OpenAI clients read it, with each model's state. Pure."""
    def card(room: Room) -> dict:
        state = room.describe(now, room is rooms.own)
        card = {"id": room.name, "object": "model", "created": created, "owned_by": OWNED_BY, "root": room.name,
                "state": str(state.state), "replicas": state.healthy}
        waking = room.sleep.waking  # set in these two states
        if state.state in (ModelState.ASLEEP, ModelState.WAKING) and waking is not None:  # "queued 12 s (Resources)"
            card["waking"] = waking.describe(time.time())
        return card

    if name is None:
        return 200, json.dumps({"object": "list", "data": [card(room) for room in rooms]}).encode()
    room = rooms.by_name.get(name)
    if room is None:
        return 404, unknown_model(name, rooms.names())
    return 200, json.dumps(card(room)).encode()


def unknown_model(model: str, names: list[str]) -> bytes:
    return wire.error_body(f"The model {model[:200]!r} is not served here. Models served: {', '.join(names)} "
                           "(GET /v1/models lists them with their state).", "invalid_request_error",
                           "model_not_found")


def no_model(names: list[str]) -> bytes:
    return wire.error_body(f"This endpoint serves several models: name one in the request body's \"model\" "
                           f"({', '.join(names)}).", "invalid_request_error", "model_required")


def gone_model(model: str) -> bytes:
    return wire.error_body(f"The model {model[:200]!r} was removed from this endpoint while the request waited.",
                           "invalid_request_error", "model_not_found")
