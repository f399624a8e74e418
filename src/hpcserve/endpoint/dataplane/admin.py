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
"""

from __future__ import annotations

import asyncio
import os
import time

from aiohttp import web

from hpcserve.endpoint.dataplane.metrics import Collector, Stats
from hpcserve.endpoint.dataplane.server import metrics_response, owner_only
from hpcserve.endpoint.protocol import (
    BACKENDS,
    HANDOVER,
    HEALTH,
    METRICS,
    MIGRATIONS,
    STATS,
    Backends,
    BackendState,
    DesiredBackends,
    HandingOver,
    Handover,
    Health,
    KvEvents,
    Migrations,
    RetiredBackend,
)


class Admin:
    """The admin routes of one data plane process (a dataplane.DataPlane: its pool, feeds, stats, log)."""

    def __init__(self, plane):
        self.plane = plane

    def backends(self) -> Backends:
        plane = self.plane
        now, limits = time.monotonic(), plane.pool.index.limits
        return Backends([BackendState(b.url, b.failed_until <= now, b.in_flight, b.capacity, b.saturated,
                                      plane.pool.kv_tokens.get(b.url), b.requests, b.failures,
                                      len(plane.pool.index.held.get(b.url) or ()), limits.get(b.url),
                                      *self.kv_events(b.url))
                         for b in plane.pool.active],
                        [RetiredBackend(b.url, b.in_flight, b.handing_over) for b in plane.pool.retired.values()],
                        str(plane.settings.policy), plane.settings.hold_s, plane.stats.held, len(plane.admission.waiting))

    def backends_json(self) -> dict:
        return self.backends().to_json()

    def kv_events(self, url: str) -> tuple[KvEvents, int | None, bool | None]:
        """Whether url's KV events are followed (live), its engine publishes none (absent), or they are not
        asked for (off: no tokenizer, or another policy); the blocks they say it holds."""
        exact, feeds = self.plane.pool.exact.get(url), self.plane.feeds
        if exact is not None:
            return KvEvents.LIVE, exact.blocks(), exact.complete
        if feeds is None:
            return KvEvents.OFF, None, None
        return (KvEvents.ABSENT if url in feeds.stats.absent else KvEvents.DOWN), None, None

    def refresh_stats(self) -> Stats:
        plane = self.plane
        plane.stats.index_blocks = plane.pool.index.entries()
        plane.stats.admission_waits, plane.stats.admission_waiting = plane.admission.waits, len(plane.admission.waiting)
        plane.stats.streams_open = len(plane.streams)
        if plane.feeds is not None:
            plane.stats.kv_events, plane.stats.kv_event_gaps = plane.feeds.stats.events, plane.feeds.stats.gaps
            plane.stats.kv_feeds_live = len(plane.pool.exact)
        return plane.stats

    async def get_backends(self, _request: web.Request) -> web.Response:
        return web.json_response(self.backends_json())

    async def put_backends(self, request: web.Request) -> web.Response:
        plane = self.plane
        try:
            plane.pool.update(DesiredBackends.from_json(await request.json()).backends)
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=400)
        if plane.feeds is not None:
            plane.feeds.sync()
        plane.changed.set()  # held requests look again (a backend may have joined or recovered)
        plane.changed = asyncio.Event()
        plane.admission.admit()  # the budget changed with the caches
        return web.json_response(self.backends_json())

    async def post_handover(self, request: web.Request) -> web.Response:
        try:
            urls = Handover.from_json(await request.json()).urls
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=400)
        pool, marked = self.plane.pool, []
        for url in urls:
            backend = pool.by_url.get(url) or pool.retired.get(url)
            if backend is not None:
                backend.handing_over = True
                marked.append(url)
        for stream in [s for s in self.plane.streams if s.backend.handing_over]:
            stream.hand_over_now()  # each moves now, not at its engine's next chunk
        return web.json_response(HandingOver(marked).to_json())

    async def get_migrations(self, request: web.Request) -> web.Response:
        try:
            after = float(request.query.get("after", "0"))
        except ValueError:
            return web.json_response({"error": "after must be a number (epoch seconds)"}, status=400)
        return web.json_response(Migrations([m for m in self.plane.migration_log if m.time > after]).to_json())

    async def get_metrics(self, _request: web.Request) -> web.Response:
        return metrics_response(Collector(self.refresh_stats(), self.backends_json()["backends"]))

    async def get_stats(self, _request: web.Request) -> web.Response:
        """What a supervisor merges over its workers."""
        return web.json_response({"stats": self.refresh_stats().to_json(), "backends": self.backends_json()})

    async def get_health(self, _request: web.Request) -> web.Response:
        return web.json_response(Health(os.getpid(), self.plane.settings.port).to_json())


def admin_app(plane) -> web.Application:
    admin = Admin(plane)
    app = web.Application(middlewares=[owner_only], client_max_size=16 * 2**20)
    app.add_routes([web.get(BACKENDS, admin.get_backends), web.put(BACKENDS, admin.put_backends),
                    web.post(HANDOVER, admin.post_handover), web.get(MIGRATIONS, admin.get_migrations),
                    web.get(METRICS, admin.get_metrics), web.get(HEALTH, admin.get_health),
                    web.get(STATS, admin.get_stats)])
    return app
