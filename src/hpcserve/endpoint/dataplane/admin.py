"""The data plane's admin API, on its owner-only Unix socket (plane.py says who may use it): its routes,
whose requests and answers are endpoint.protocol's (the contract with the controller):

    GET  /backends          protocol.Backends: the backends, their settings, requests in flight through
                            here, failures, held requests, and whether each engine's KV events are followed
    PUT  /backends          protocol.DesiredBackends: the whole desired set (idempotent)
    POST /handover          protocol.Handover: these backends are drained; their open streams move to others
                            now (streams.py), what cannot move finishes where it is
    GET  /migrations?after=T  protocol.Migrations: streams moved (or not) since T (epoch seconds)
    GET  /metrics           this process's Prometheus metrics
    GET  /stats, /health    what a supervisor of several workers merges; who serves (protocol.Health)
    GET  /models            protocol.Models: the models (rooms) served here, each with its state
    PUT  /models/NAME       protocol.ModelSpec: a model joins (or its settings change)
    DELETE /models/NAME     the model leaves (its held requests get 404; its running ones finish)
    PUT  /waking            protocol.Waking: a model that sleeps when idle, as its controller sees it (waking.py)
    GET  /waking?after=N&wait_s=S  protocol.Wakes: requests that found it without a replica (a long poll)

/backends, /handover, /migrations and /waking act on one model's room: ?model=NAME, or without it the data plane's
own model (so a controller that knows of one model only works as before). A model not here: 404.
"""

from __future__ import annotations

import os
import time

from aiohttp import web

from hpcserve.endpoint.dataplane.metrics import Collector, Stats, merge_counts
from hpcserve.endpoint.dataplane.rooms import Room
from hpcserve.endpoint.dataplane.server import metrics_response, owner_only
from hpcserve.endpoint.protocol import (
    BACKENDS,
    HANDOVER,
    HEALTH,
    METRICS,
    MIGRATIONS,
    MODEL_PARAM,
    MODELS,
    STATS,
    WAKE_POLL_MAX_S,
    WAKING,
    Backends,
    BackendState,
    DesiredBackends,
    HandingOver,
    Handover,
    Health,
    KvEvents,
    Migrations,
    ModelSpec,
    RetiredBackend,
    Waking,
)


class NotHere(Exception):
    """The admin call names a model the data plane does not serve."""


class Admin:
    """The admin routes of one data plane process (a dataplane.DataPlane: its rooms, stats, session)."""

    def __init__(self, plane):
        self.plane = plane

    def room(self, request: web.Request | None) -> Room:
        """The room the call is about: ?model=NAME, else the data plane's own. NotHere: no such model."""
        name = request.query.get(MODEL_PARAM) if request is not None else None
        room = self.plane.rooms.own if name is None else self.plane.rooms.by_name.get(name)
        if room is None:
            raise NotHere(f"no model {name!r} here; models: {', '.join(self.plane.rooms.names())}")
        return room

    def backends(self, room: Room) -> Backends:
        now, limits = time.monotonic(), room.pool.index.limits
        return Backends([BackendState(b.url, b.failed_until <= now, b.in_flight, b.capacity, b.saturated,
                                      room.pool.kv_tokens.get(b.url), b.requests, b.failures,
                                      len(room.pool.index.held.get(b.url) or ()), limits.get(b.url),
                                      *self.kv_events(room, b.url))
                         for b in room.pool.active],
                        [RetiredBackend(b.url, b.in_flight, b.handing_over) for b in room.pool.retired.values()],
                        str(room.policy), room.hold_s, room.held, len(room.admission.waiting))

    def backends_json(self, room: Room) -> dict:
        return self.backends(room).to_json()

    def all_backends(self) -> list[dict]:
        """Every model's backends (what /metrics shows: their URLs tell them apart)."""
        return [b for room in self.plane.rooms for b in self.backends_json(room)["backends"]]

    @staticmethod
    def kv_events(room: Room, url: str) -> tuple[KvEvents, int | None, bool | None]:
        """Whether url's KV events are followed (live), its engine publishes none (absent), or they are not
        asked for (off: no tokenizer, or another policy); the blocks they say it holds."""
        exact, feeds = room.pool.exact.get(url), room.feeds
        if exact is not None:
            return KvEvents.LIVE, exact.blocks(), exact.complete
        if feeds is None:
            return KvEvents.OFF, None, None
        return (KvEvents.ABSENT if url in feeds.stats.absent else KvEvents.DOWN), None, None

    def refresh_stats(self) -> Stats:
        plane, rooms = self.plane, list(self.plane.rooms)
        plane.stats.index_blocks = sum(room.pool.index.entries() for room in rooms)
        plane.stats.admission_waits = sum(room.admission.waits for room in rooms)
        plane.stats.admission_waiting = sum(len(room.admission.waiting) for room in rooms)
        plane.stats.stream_pauses = sum(room.admission.pauses for room in rooms)
        plane.stats.admission_wait = {}
        for room in rooms:
            merge_counts(plane.stats.admission_wait, room.admission.waited)
        plane.stats.streams_open = len(plane.streams)
        feeds = [room for room in rooms if room.feeds is not None]
        if feeds:
            plane.stats.kv_events = sum(room.feeds.stats.events for room in feeds)
            plane.stats.kv_event_gaps = sum(room.feeds.stats.gaps for room in feeds)
            plane.stats.kv_feeds_live = sum(len(room.pool.exact) for room in feeds)
        return plane.stats

    async def get_backends(self, request: web.Request) -> web.Response:
        return web.json_response(self.backends_json(self.room(request)))

    async def put_backends(self, request: web.Request) -> web.Response:
        room = self.room(request)
        try:
            room.pool.update(DesiredBackends.from_json(await request.json()).backends)
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=400)
        if room.feeds is not None:
            room.feeds.sync()
        room.wake()  # held requests look again (a backend may have joined or recovered); admission recounts
        return web.json_response(self.backends_json(room))

    async def post_handover(self, request: web.Request) -> web.Response:
        room = self.room(request)
        try:
            urls = Handover.from_json(await request.json()).urls
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=400)
        pool, marked = room.pool, []
        for url in urls:
            backend = pool.by_url.get(url) or pool.retired.get(url)
            if backend is not None:
                backend.handing_over = True
                marked.append(url)
        for stream in [s for s in self.plane.streams if s.backend.handing_over]:
            stream.hand_over_now()  # each moves now, not at its engine's next chunk
        return web.json_response(HandingOver(marked).to_json())

    async def get_migrations(self, request: web.Request) -> web.Response:
        room = self.room(request)
        try:
            after = float(request.query.get("after", "0"))
        except ValueError:
            return web.json_response({"error": "after must be a number (epoch seconds)"}, status=400)
        return web.json_response(Migrations([m for m in room.migration_log if m.time > after]).to_json())

    async def get_models(self, _request: web.Request) -> web.Response:
        return web.json_response(self.plane.rooms.models(time.monotonic()).to_json())

    async def put_waking(self, request: web.Request) -> web.Response:
        room = self.room(request)
        try:
            waking = Waking.from_json(await request.json())
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        room.sleep.set(waking)
        room.wake()  # waiting requests look again (their comments and refusals follow the new phase)
        return web.json_response(waking.to_json())

    async def get_waking(self, request: web.Request) -> web.Response:
        room = self.room(request)
        try:
            after = int(request.query.get("after", "-1"))
            wait_s = min(float(request.query.get("wait_s", "0")), WAKE_POLL_MAX_S)
        except ValueError:
            return web.json_response({"error": "after must be a whole number, wait_s a number"}, status=400)
        wakes = await room.sleep.wakes(after, wait_s, 0)
        return web.json_response(wakes.__class__(wakes.asked, room.held).to_json())

    async def put_model(self, request: web.Request) -> web.Response:
        own = self.plane.rooms.own
        if request.match_info["name"] == own.name:  # another deployment's would take it over
            return web.json_response({"error": f"{own.name} is this data plane's own model: another deployment "
                                      "cannot join under its name"}, status=409)
        try:
            spec = ModelSpec.from_json({**await request.json(), "name": request.match_info["name"]})
            await self.plane.add_model(spec)
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=400)
        return await self.get_models(request)

    async def delete_model(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        rooms = self.plane.rooms
        if name == rooms.own.name:
            return web.json_response({"error": f"{name} is this data plane's own model: it leaves only when the "
                                      "data plane stops"}, status=409)
        await self.plane.remove_model(name)  # idempotent: a model not here has left already
        return await self.get_models(request)

    async def get_metrics(self, _request: web.Request) -> web.Response:
        return metrics_response(Collector(self.refresh_stats(), self.all_backends()))

    async def get_stats(self, _request: web.Request) -> web.Response:
        """What a supervisor merges over its workers."""
        return web.json_response({"stats": self.refresh_stats().to_json(), "backends": {"backends": self.all_backends()}})

    async def get_health(self, _request: web.Request) -> web.Response:
        return web.json_response(Health(os.getpid(), self.plane.settings.port).to_json())


@web.middleware
async def model_scope(request: web.Request, handler):
    """A call about a model not served here: 404 naming those that are."""
    try:
        return await handler(request)
    except NotHere as exc:
        return web.json_response({"error": str(exc)}, status=404)


def admin_app(plane) -> web.Application:
    admin = Admin(plane)
    app = web.Application(middlewares=[owner_only, model_scope], client_max_size=16 * 2**20)
    app.add_routes([web.get(BACKENDS, admin.get_backends), web.put(BACKENDS, admin.put_backends),
                    web.post(HANDOVER, admin.post_handover), web.get(MIGRATIONS, admin.get_migrations),
                    web.get(METRICS, admin.get_metrics), web.get(HEALTH, admin.get_health),
                    web.get(STATS, admin.get_stats), web.get(MODELS, admin.get_models),
                    web.put(MODELS + "/{name}", admin.put_model), web.delete(MODELS + "/{name}", admin.delete_model),
                    web.put(WAKING, admin.put_waking), web.get(WAKING, admin.get_waking)])
    return app
