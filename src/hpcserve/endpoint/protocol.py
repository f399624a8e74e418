"""The contract between the endpoint's two rooms: the data plane's admin API, typed and defined once, and
the name its process goes by. The data plane (endpoint/dataplane/) serves these answers; the controller's
client of it (endpoint/control/plane_client.py) and `status` (control/holding.py) read them. Both rooms
import this module; neither imports the other. No I/O.

The admin API, on the data plane's owner-only Unix socket (clients' port has no admin route):

    GET  /backends            -> Backends: each backend's settings and counters, retired ones, held requests
    PUT  /backends            DesiredBackends (the whole desired set, idempotent) -> Backends
    POST /handover            Handover: these backends are drained, their open streams move now -> HandingOver
    GET  /migrations?after=T  -> Migrations: streams moved (or not) since T (epoch seconds)
    GET  /metrics             the data plane's Prometheus text
    GET  /health              -> Health: who serves (the PID a controller checks before trusting the socket)
    GET  /stats               a worker's counters and its /backends (what a supervisor of several merges)
    GET  /models              -> Models: every model (room) the data plane serves, and its state
    PUT  /models/NAME         ModelSpec: a model joins (idempotent: its settings change) -> Models
    DELETE /models/NAME       the model leaves: no new request reaches it, its own run on -> Models
    PUT  /waking              Waking: a model that sleeps when idle (autoscale.min 0), asleep, waking or serving
    GET  /waking?after=N&wait_s=S  -> Wakes: requests that found the sleeping model without a replica; answered
                              at once when more than N did, else when one does or after S seconds (a long poll:
                              the controller hears of a request for a sleeping model at once)

Several models share one data plane (one URL): each is a room of its own (its replicas, routing, admission,
held requests, migrations). /backends, /handover and /migrations take ?model=NAME (MODEL_PARAM); without
it they mean the data plane's own model (the one its command line named), so a caller that knows of one
model only is answered as before.

A malformed request is answered 400 with {"error": "..."}; from_json raises ValueError naming what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from hpcserve.engine.capacity import DEFAULT_MAX_NUM_SEQS

MODULE = "hpcserve.endpoint.dataplane"  # python -m MODULE: the controller starts it, and knows it by it
PROCESS_TITLE = "hpcserve-router"  # ...or by its process title (`ps`)

BACKENDS = "/backends"
HANDOVER = "/handover"
MIGRATIONS = "/migrations"
METRICS = "/metrics"
HEALTH = "/health"
STATS = "/stats"
MODELS = "/models"
WAKING = "/waking"
WAKE_POLL_MAX_S = 30.0  # the longest GET /waking waits for a request
MODEL_PARAM = "model"  # ?model=NAME on /backends, /handover, /migrations: that model's room

MAX_CAPACITY = 1 << 20
MAX_KV_TOKENS = 1 << 40


@dataclass(frozen=True)
class BackendSpec:
    """One backend as the controller wants it: where, how many requests its engine runs at once, and
    whether its engine is saturated (queueing) now."""

    url: str
    capacity: int = DEFAULT_MAX_NUM_SEQS
    saturated: bool = False
    kv_tokens: int | None = None  # the engine's KV cache in tokens, when known: bounds what the index keeps

    @classmethod
    def from_json(cls, data: object) -> BackendSpec:
        """From the admin API's JSON. Raises ValueError naming what is wrong."""
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            raise ValueError(f"a backend is an object with a 'url' string, not {str(data)[:80]}")  # noqa: TRY004
        url = data["url"].rstrip("/")
        if not url.startswith(("http://", "https://")) or "\n" in url or " " in url:
            raise ValueError(f"backend url {url[:80]!r} is not an http(s) URL")
        capacity = data.get("capacity", DEFAULT_MAX_NUM_SEQS)
        if not isinstance(capacity, int) or isinstance(capacity, bool) or not 0 < capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity of {url} must be a whole number from 1 to {MAX_CAPACITY}, not {capacity!r}")
        saturated = data.get("saturated", False)
        if not isinstance(saturated, bool):
            raise ValueError(f"saturated of {url} must be true or false, not {saturated!r}")  # noqa: TRY004
        kv_tokens = data.get("kv_tokens")
        if kv_tokens is not None and (not isinstance(kv_tokens, int) or isinstance(kv_tokens, bool)
                                      or not 0 < kv_tokens <= MAX_KV_TOKENS):
            raise ValueError(f"kv_tokens of {url} must be a whole number above 0 (or absent), not {kv_tokens!r}")
        return cls(url, capacity, saturated, kv_tokens)

    def to_json(self) -> dict:
        data = {"url": self.url, "capacity": self.capacity, "saturated": self.saturated}
        return data if self.kv_tokens is None else {**data, "kv_tokens": self.kv_tokens}


@dataclass(frozen=True)
class DesiredBackends:
    """PUT /backends: the controller's whole desired set, in join order (idempotent)."""

    backends: list[BackendSpec]

    @classmethod
    def from_json(cls, data: object) -> DesiredBackends:
        """Raises ValueError, KeyError or TypeError (the answer 400 names which)."""
        return cls([BackendSpec.from_json(item) for item in data["backends"]])  # type: ignore[index]

    def to_json(self) -> dict:
        return {"backends": [spec.to_json() for spec in self.backends]}


class KvEvents(StrEnum):
    """Whether the data plane follows a backend's KV events."""

    LIVE = "live"  # followed now
    ABSENT = "absent"  # its engine publishes none
    DOWN = "down"  # asked for, not followed now
    OFF = "off"  # not asked for (no tokenizer, or another policy)


@dataclass(frozen=True)
class BackendState:
    """One backend in GET /backends: its settings and what the data plane counts there."""

    url: str
    healthy: bool  # not skipped after a connection error
    in_flight: int  # requests the data plane has sent there and not finished
    capacity: int = DEFAULT_MAX_NUM_SEQS
    saturated: bool = False
    kv_tokens: int | None = None
    requests: int = 0  # sent there since it joined
    failures: int = 0  # connection errors
    index_blocks: int = 0  # prompt blocks the data plane's prefix index holds for it
    index_limit: int | None = None
    kv_events: KvEvents | None = None
    exact_blocks: int | None = None  # the blocks its KV events say it holds (while live)
    exact_complete: bool | None = None

    @property
    def spec(self) -> BackendSpec:
        return BackendSpec(self.url, self.capacity, self.saturated, self.kv_tokens)

    @classmethod
    def from_json(cls, data: dict) -> BackendState:
        kv_events = data.get("kv_events")
        return cls(data["url"], not data.get("failed"), int(data.get("in_flight") or 0), int(data.get("capacity") or 1),
                   bool(data.get("saturated")), data.get("kv_tokens"), int(data.get("requests") or 0),
                   int(data.get("failures") or 0), int(data.get("index_blocks") or 0), data.get("index_limit"),
                   KvEvents(kv_events) if kv_events else None, data.get("exact_blocks"), data.get("exact_complete"))

    def to_json(self) -> dict:
        data = {**self.spec.to_json(), "in_flight": self.in_flight, "failed": not self.healthy,
                "requests": self.requests, "failures": self.failures, "index_blocks": self.index_blocks,
                "index_limit": self.index_limit}
        if self.kv_events is not None:
            data["kv_events"] = str(self.kv_events)
        if self.exact_blocks is not None:
            data.update(exact_blocks=self.exact_blocks, exact_complete=self.exact_complete)
        return data


@dataclass(frozen=True)
class RetiredBackend:
    """A backend taken out while requests still ran there, until they end."""

    url: str
    in_flight: int
    handing_over: bool = False  # drained: its streams move to other backends

    @classmethod
    def from_json(cls, data: dict) -> RetiredBackend:
        return cls(data["url"], int(data.get("in_flight") or 0), bool(data.get("handing_over")))

    def to_json(self) -> dict:
        return {"url": self.url, "in_flight": self.in_flight, "handing_over": self.handing_over}


@dataclass(frozen=True)
class Backends:
    """GET /backends (and the answer to PUT /backends): the backends, the retired ones, requests held."""

    backends: list[BackendState] = field(default_factory=list)
    retired: list[RetiredBackend] = field(default_factory=list)
    policy: str | None = None
    hold_s: float | None = None  # how long a request is held while no backend can take it, then 503
    held: int = 0  # requests held now
    waiting: int = 0  # requests admission keeps waiting: for room in the KV caches, or a place (fair share)
    workers: int = 1

    @classmethod
    def from_json(cls, data: dict) -> Backends:
        return cls([BackendState.from_json(b) for b in data.get("backends", [])],
                   [RetiredBackend.from_json(b) for b in data.get("retired", [])], data.get("policy"),
                   data.get("hold_s"), int(data.get("held") or 0), int(data.get("waiting") or 0),
                   int(data.get("workers") or 0))

    def to_json(self) -> dict:
        return {"policy": self.policy, "hold_s": self.hold_s, "held": self.held, "workers": self.workers,
                "waiting": self.waiting, "backends": [b.to_json() for b in self.backends],
                "retired": [b.to_json() for b in self.retired]}

    def can_take_requests(self) -> bool:
        """A backend that has not failed: the data plane sends requests there (a saturated one too, when
        it is the only one)."""
        return any(b.healthy for b in self.backends)

    def in_flight_to(self, url: str) -> int:
        """Requests still running through the data plane to url, removed (retired) or not."""
        return (sum(b.in_flight for b in self.backends if b.url == url)
                + sum(r.in_flight for r in self.retired if r.url == url))


def backends_from_json(data: dict) -> list[BackendState]:
    """The backends of a GET /backends answer."""
    return Backends.from_json(data).backends


def in_flight_to(data: dict, url: str) -> int:
    """Requests still running through the data plane to url (a GET /backends answer), retired or not."""
    return Backends.from_json(data).in_flight_to(url)


@dataclass(frozen=True)
class Handover:
    """POST /handover: these backends are drained; their open streams move to other backends now."""

    urls: list[str]

    @classmethod
    def from_json(cls, data: object) -> Handover:
        """Raises ValueError, KeyError or TypeError (the answer 400 names which)."""
        return cls([str(url).rstrip("/") for url in data["urls"]])  # type: ignore[index]

    def to_json(self) -> dict:
        return {"urls": self.urls}


@dataclass(frozen=True)
class HandingOver:
    """The answer to POST /handover: the backends the data plane knew, now handing over."""

    urls: list[str]

    @classmethod
    def from_json(cls, data: dict) -> HandingOver:
        return cls(list(data["handing_over"]))

    def to_json(self) -> dict:
        return {"handing_over": self.urls}


@dataclass(frozen=True)
class Migration:
    """One stream moved to another replica, or one that could not be (to: None, reason says why)."""

    time: float  # epoch seconds
    cause: str
    source: str
    to: str | None
    kind: str
    tokens: int  # generated tokens the client had when it moved
    reason: str | None = None

    @classmethod
    def from_json(cls, data: dict) -> Migration:
        return cls(data["time"], data["cause"], data["from"], data.get("to"), data["kind"], data["tokens"],
                   data.get("reason"))

    def to_json(self) -> dict:
        return {"time": self.time, "cause": self.cause, "from": self.source, "to": self.to, "kind": self.kind,
                "tokens": self.tokens, "reason": self.reason}


@dataclass(frozen=True)
class Migrations:
    """GET /migrations?after=T: the streams moved (or not) since T, oldest first."""

    migrations: list[Migration]

    @classmethod
    def from_json(cls, data: dict) -> Migrations:
        return cls([Migration.from_json(m) for m in data.get("migrations", [])])

    def to_json(self) -> dict:
        return {"migrations": [m.to_json() for m in self.migrations]}


@dataclass(frozen=True)
class Health:
    """GET /health: the process behind the socket (a controller checks the PID before it trusts it)."""

    pid: int
    port: int
    workers: list[int] | None = None  # a supervisor's workers' PIDs

    @classmethod
    def from_json(cls, data: dict) -> Health:
        return cls(int(data["pid"]), int(data["port"]), data.get("workers"))

    def to_json(self) -> dict:
        data = {"pid": self.pid, "port": self.port}
        return data if self.workers is None else {**data, "workers": self.workers}


class ModelState(StrEnum):
    """A model's state behind the data plane, as GET /v1/models tells clients."""

    SERVING = "serving"  # some replica in its pool may take requests now
    STARTING = "starting"  # no replica yet (or none healthy): its requests are held up to hold_s, then 503
    ASLEEP = "asleep"  # scaled to zero (autoscale.min 0): a request wakes it and waits (wake_wait_s)
    WAKING = "waking"  # a replica is queued or starting for it: requests wait (wake_wait_s)


class WakePhase(StrEnum):
    """Where a model that sleeps when idle stands, as its controller tells the data plane (PUT /waking)."""

    SERVING = "serving"  # a replica serves (or the model is not at zero)
    ASLEEP = "asleep"  # no replica, none launched
    QUEUED = "queued"  # a replica's job waits in Slurm's queue
    STARTING = "starting"  # a replica's job (or local process) runs: the engine is starting


@dataclass(frozen=True)
class Waking:
    """PUT /waking: the controller's word on a model that sleeps when idle (autoscale.min 0). The data plane
    holds a request for it while no replica serves, up to wait_s, with SSE comments to a stream, and answers
    503 with Retry-After early when ready_at is later than the request's wait allows."""

    phase: WakePhase
    since: float  # epoch seconds: when this phase began
    wait_s: float  # autoscale.wake_wait_s: how long a request waits for a replica
    reason: str | None = None  # while queued: Slurm's pending reason (Resources, Priority, ...)
    position: int | None = None  # while queued: the job's place among the pending jobs, when known
    ready_at: float | None = None  # epoch seconds: when a replica should serve (Slurm's start + startup); None: unknown
    member: str | None = None  # the member waking

    @classmethod
    def from_json(cls, data: object) -> Waking:
        """Raises ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("a waking state is an object with 'phase', 'since' and 'wait_s'")  # noqa: TRY004
        try:
            phase = WakePhase(data["phase"])
            since, wait_s = float(data["since"]), float(data["wait_s"])
            ready_at = float(data["ready_at"]) if data.get("ready_at") is not None else None
            position = int(data["position"]) if data.get("position") is not None else None
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a waking state needs phase ({', '.join(WakePhase)}), since and wait_s as numbers: "
                             f"{exc}") from None
        if not wait_s > 0:
            raise ValueError(f"wait_s must be > 0, not {wait_s}")
        reason, member = data.get("reason"), data.get("member")
        return cls(phase, since, wait_s, str(reason)[:200] if reason else None, position, ready_at,
                   str(member)[:200] if member else None)

    def to_json(self) -> dict:
        return {"phase": str(self.phase), "since": self.since, "wait_s": self.wait_s, "reason": self.reason,
                "position": self.position, "ready_at": self.ready_at, "member": self.member}

    def describe(self, now: float) -> str:
        """e.g. "queued 12 s (Resources, position 3)", "engine starting 40 s", "asleep". Pure."""
        took = f"{max(0.0, now - self.since):.0f} s"
        if self.phase is WakePhase.QUEUED:
            why = ", ".join(part for part in (self.reason, self.position and f"position {self.position}") if part)
            return f"queued {took}" + (f" ({why})" if why else "")
        if self.phase is WakePhase.STARTING:
            return f"engine starting {took}"
        return str(self.phase)


@dataclass(frozen=True)
class Wakes:
    """GET /waking: requests that found the sleeping model without a replica (counted since the data plane
    started; a supervisor sums its workers'), and those held for it now."""

    asked: int
    held: int = 0

    @classmethod
    def from_json(cls, data: dict) -> Wakes:
        return cls(int(data.get("asked") or 0), int(data.get("held") or 0))

    def to_json(self) -> dict:
        return {"asked": self.asked, "held": self.held}


@dataclass(frozen=True)
class ModelSpec:
    """PUT /models/NAME: one model (its served name) and how its own requests are routed and held."""

    name: str
    policy: str = "least_loaded"
    hold_s: float = 60.0
    tokenizer: str | None = None  # its model folder (tokenizer.json): prefix routing by its engines' KV events
    chat_template: str | None = None

    @classmethod
    def from_json(cls, data: object) -> ModelSpec:
        """Raises ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("a model is an object with a 'name'")  # noqa: TRY004
        name = data.get("name")
        if not isinstance(name, str) or not name or len(name) > 512 or any(c in name for c in "\n\r\0"):
            raise ValueError(f"a model's name must be a non-empty string (its served name), not {str(name)[:80]!r}")
        hold_s = data.get("hold_s", 60.0)
        if not isinstance(hold_s, (int, float)) or isinstance(hold_s, bool) or hold_s < 0:
            raise ValueError(f"hold_s of {name} must be a number >= 0, not {hold_s!r}")
        policy = data.get("policy", "least_loaded")
        tokenizer, template = data.get("tokenizer"), data.get("chat_template")
        for field_name, value in (("policy", policy), ("tokenizer", tokenizer), ("chat_template", template)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{field_name} of {name} must be a string, not {value!r}")
        return cls(name, policy, float(hold_s), tokenizer, template)

    def to_json(self) -> dict:
        return {"name": self.name, "policy": self.policy, "hold_s": self.hold_s, "tokenizer": self.tokenizer,
                "chat_template": self.chat_template}


@dataclass(frozen=True)
class ModelRoom:
    """One model in GET /models: its settings, its replicas in the pool, and whether it is the data plane's
    own (the one its command line named: it leaves only when the data plane stops)."""

    name: str
    state: ModelState
    backends: int
    healthy: int
    policy: str
    hold_s: float
    own: bool = False

    @classmethod
    def from_json(cls, data: dict) -> ModelRoom:
        return cls(data["name"], ModelState(data["state"]), int(data.get("backends") or 0),
                   int(data.get("healthy") or 0), data.get("policy") or "", float(data.get("hold_s") or 0),
                   bool(data.get("own")))

    def to_json(self) -> dict:
        return {"name": self.name, "state": str(self.state), "backends": self.backends, "healthy": self.healthy,
                "policy": self.policy, "hold_s": self.hold_s, "own": self.own}


@dataclass(frozen=True)
class Models:
    """GET /models (and the answer to PUT and DELETE /models/NAME): the data plane's models, in join order."""

    models: list[ModelRoom]

    @classmethod
    def from_json(cls, data: dict) -> Models:
        return cls([ModelRoom.from_json(m) for m in data.get("models", [])])

    def to_json(self) -> dict:
        return {"models": [m.to_json() for m in self.models]}

    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def joined(self) -> list[str]:
        """The models that joined the data plane's own (their deployments keep it serving)."""
        return [m.name for m in self.models if not m.own]
