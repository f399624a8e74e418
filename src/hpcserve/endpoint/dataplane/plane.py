"""The endpoint's data plane: one OpenAI URL in front of the replicas, in a process of its own (or
several worker processes on one port).

    python -m hpcserve.endpoint.dataplane --host H --port P --key-file F --admin-socket S [--model NAME]
                                          [--policy prefix|least_loaded|round_robin] [--hold-s 60] [--workers N]

Models. Each model is a room of its own (rooms.py): its replicas, routing, admission, held requests and
migrations. --model names the data plane's own; other deployments' models join and leave over the admin
socket (PUT/DELETE /models/NAME) while it serves. With one model a request goes to it unread; with several,
the body's "model" picks the room (400 without one, 404 for one not here, each naming those there are).
GET /v1/models is answered here from the rooms (each model with its state) once the data plane knows its
model's name; without --model it is the engines' to answer, as every route is.

Clients (H:P). Every route goes to a replica that routing.choose picks (completions, chat, models,
embeddings, tokenize, ...): the body passed on as bytes (the prefix policy also parses the prompt to
route it: prefix_index); a response with a length up to --max-buffer-mb passed whole, any other (SSE
streams, larger bodies) chunk by chunk as it arrives; status and headers kept. Each request must carry
`Authorization: Bearer KEY` (core.keys.KeyCheck: hashed, constant time, no cache of tokens); a missing
or wrong key gets 401 with an OpenAI-style JSON body that says where the key is (wire.UNAUTHORIZED).
GET /health alone is open and answers 200 from here: it says that this process lives and nothing else
(no replica, no count), reaches no replica and changes nothing.
Admin (the Unix socket S: mode 0600 in an owner-only folder, and the peer's uid checked): only the user
who started the endpoint can change what it serves. Never on the client port (404 there). Its routes:
endpoint/dataplane/admin.py.
Failures. A connection refused before the request was sent goes to another backend (at most --tries
attempts) and keeps that backend out for --failed-s; one dropped after it was sent (the engine may have
it) is sent again at most --resends times. Once the client got a byte, a stream whose replica fails (or is
drained) continues on another replica, at most --migrations times (endpoint/dataplane/streams.py); nothing else is
retried then. An engine's 5xx is passed on. A client that leaves closes the engine's connection at once.
While no backend can take a request (the pool empty during a handover, the one replica being replaced),
requests are held up to --hold-s and sent on as soon as one is added; then 503 JSON with Retry-After.
Prefills wait while prompts in flight take the replicas' KV caches (endpoint/dataplane/admission.py).
Bounds: body size (413), header and body read times against slow clients, open connections (503 at
accept), the wait for an engine's first byte and its silences between chunks (504 / a cut stream), and a
malformed request gets a JSON 4xx while the server serves on.
With --workers N > 1 (serve.router_workers), N processes accept on the port (SO_REUSEPORT) and tell each
other what they route where; a supervisor serves the admin socket for all of them (endpoint/dataplane/workers.py).
`ps` shows it as "hpcserve-router --port P ..."; control.plane_client.Router starts, finds and stops it by PID.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
import time
from pathlib import Path
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from hpcserve.core.errors import HpcserveError
from hpcserve.core.keys import KeyCheck, bearer, read_key_file
from hpcserve.core.logs import configure_process_logging
from hpcserve.core.net import remove_unix_socket
from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane import wire
from hpcserve.endpoint.dataplane.admin import admin_app
from hpcserve.endpoint.dataplane.admission import FairShare, Ticket
from hpcserve.endpoint.dataplane.metrics import CLIENT_CLOSED, Stats
from hpcserve.endpoint.dataplane.migration import Request as Migratable
from hpcserve.endpoint.dataplane.migration import prepare
from hpcserve.endpoint.dataplane.rooms import NoRoom, Room, Rooms, gone_model, models_answer
from hpcserve.endpoint.dataplane.routing import choose
from hpcserve.endpoint.dataplane.routing.log import RoutingLog
from hpcserve.endpoint.dataplane.routing.table import Affinity, Backend
from hpcserve.endpoint.dataplane.server import (
    RELAYED,
    ClientServer,
    RelayedStream,
    answered_status,
    bind_admin_socket,
    client_sockets,
    request_key,
)
from hpcserve.endpoint.dataplane.settings import Settings, parse_args
from hpcserve.endpoint.dataplane.streams import Lease, Stream
from hpcserve.endpoint.dataplane.tenants import Visit, limit_refusal, model_refusal, tenant_view
from hpcserve.endpoint.dataplane.waking import answer_in_stream, wait_for_wake, waiting_stream
from hpcserve.endpoint.dataplane.workers import supervise
from hpcserve.endpoint.protocol import PROCESS_TITLE, Migration, ModelSpec
from hpcserve.tenancy.limits import missing_max_tokens
from hpcserve.tenancy.settings import TenancySettings
from hpcserve.tenancy.view import Tenant, TenantView

# Engines (uvicorn) close idle keep-alive connections after 5 s; closing ours first spares requests the
# race of a connection closed under them.
UPSTREAM_KEEPALIVE_S = 4.0
URL_CACHE_SIZE = 4096
VISIT = request_key("hpcserve.visit", Visit)  # a tenant's request: its tenants.Visit, on the aiohttp request

log = logging.getLogger(__name__)


class Refusal(Exception):
    """An answer of the data plane's own (JSON), raised where the request cannot go on."""

    def __init__(self, status: int, body: bytes, close: bool = False, retry_after: bool | int = False):
        """retry_after: True for the data plane's usual Retry-After (wire.RETRY_AFTER_S), or the seconds."""
        super().__init__(status)
        self.status, self.body, self.close, self.retry_after = status, body, close, retry_after

    def response(self) -> web.Response:
        headers = None
        if self.retry_after is not False:
            headers = {"Retry-After": str(wire.RETRY_AFTER_S if self.retry_after is True else self.retry_after)}
        response = web.Response(status=self.status, body=self.body, content_type="application/json", headers=headers)
        if self.close:  # the rest of the request (a body too large, too slow) is never read
            response.force_close()
        return response


class AttemptFailed(Exception):
    def __init__(self, failure: wire.Failure, detail: str):
        super().__init__(detail)
        self.failure, self.detail = failure, detail


class DataPlane:
    def __init__(self, settings: Settings, key: str | None, tenants: TenantView | None = None):
        """tenants: users' keys, limits and usage (tenants.py); None: the deployment's key alone."""
        self.settings = settings
        self.key, self.raw_key = KeyCheck(key), key
        self.tenants = tenants
        self.engine_auth = bearer(key)  # what the engines get in place of a user's key
        self.stats = Stats()
        self.session: aiohttp.ClientSession | None = None
        self.urls: dict[tuple[str, str], URL] = {}  # (backend, path) -> parsed URL: a few paths are most requests
        self.streams: set = set()  # streams.Stream open now: a handover moves them at once
        self.rooms = Rooms(Room(settings.model or "", settings.policy, settings.hold_s, settings.admit_kv_share,
                                settings.workers, self.fair_share()))
        self.created = int(time.time())  # what GET /v1/models tells clients of every model
        self.choose = choose
        if settings.routing_log and settings.policy is Routing.PREFIX:
            self.choose = RoutingLog(settings.routing_log).choose

    def fair_share(self) -> FairShare | None:
        """A model's own fair share (its replicas' places are shared among the users of that model alone)."""
        tenants = self.tenants
        return FairShare(tenants.shares, tenants.pause_streams) if tenants is not None else None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.settings.max_connections, limit_per_host=0,
                                         keepalive_timeout=UPSTREAM_KEEPALIVE_S, ttl_dns_cache=300)
        # Reads are bounded here, per phase (first byte, then between chunks), not by aiohttp's one sock_read.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout_s)
        # No proxies from the environment (the engines are reached directly), no cookies, bodies as bytes.
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False,
                                             auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                                             skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"))
        warning = self.rooms.own.load_tokenizer(self.session, self.raw_key, self.settings.tokenizer,
                                                self.settings.chat_template)
        if warning:
            log.warning("%s, not by the engines' KV events", warning)

    async def close(self) -> None:
        for room in self.rooms:
            if room.feeds is not None:
                await room.feeds.close()
        if self.session is not None:
            await self.session.close()

    # -------------------------------------------------------------- models

    async def add_model(self, spec: ModelSpec) -> Room:
        """A model joins (its requests are held until its replicas join its pool), or an existing one's
        settings change (its pool and the requests it holds stay). ValueError: a policy unknown here."""
        policy = Routing(spec.policy)
        room = self.rooms.by_name.get(spec.name)
        if room is not None:
            room.hold_s = spec.hold_s
            return room
        room = Room(spec.name, policy, spec.hold_s, self.settings.admit_kv_share, self.settings.workers,
                    self.fair_share())
        folder, template = (Path(spec.tokenizer) if spec.tokenizer else None,
                            Path(spec.chat_template) if spec.chat_template else None)
        warning = await asyncio.to_thread(room.load_tokenizer, self.session, self.raw_key, folder, template)
        if warning:
            log.warning("%s", warning)
        self.rooms.add(room)
        log.info("model %s joined (policy %s, hold %g s); models: %s", spec.name, policy, spec.hold_s,
                 ", ".join(self.rooms.names()))
        return room

    async def remove_model(self, name: str) -> bool:
        """The model leaves: its held requests get 404, those running finish on their replicas. False when
        it was not here."""
        room = self.rooms.remove(name)
        if room is None:
            return False
        await room.close()
        log.info("model %s left; models: %s", name, ", ".join(self.rooms.names()))
        return True

    def list_models(self, target: str) -> web.Response:
        path = target.split("?", 1)[0]
        name = unquote(path[len("/v1/models/"):]) if path.startswith("/v1/models/") else None
        status, body = models_answer(self.rooms, self.created, time.monotonic(), name)
        return web.Response(status=status, body=body, content_type="application/json")

    # -------------------------------------------------------------- clients

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        started = time.monotonic()
        status = CLIENT_CLOSED
        try:
            response = await self.answer(request)
            status = response.status
            return response
        except Refusal as refusal:
            status = refusal.status
            return refusal.response()
        finally:
            if status == CLIENT_CLOSED:  # cancelled: the client left, perhaps with the whole answer
                status = answered_status(request) or status
            now = time.monotonic()
            self.stats.done(status, now - started)
            visit = request.get(VISIT)
            if visit is not None and self.tenants is not None:  # a Visit is kept only with tenants (admit_tenant)
                row = visit.row(status, now)
                self.tenants.ended(row)
                self.stats.used(row.project, row.prompt_tokens, row.completion_tokens)

    async def answer(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.raw_path == "/health" and request.method == "GET":
            return web.Response()
        tenant = None
        if self.tenants is None:
            if not self.key.allows(request.headers.get("Authorization")):
                raise Refusal(401, wire.UNAUTHORIZED)
        else:
            tenant = self.tenants.identify(request.headers.get("Authorization"), time.time())
            if tenant is None:
                raise Refusal(401, wire.UNAUTHORIZED)
        target = request.raw_path
        if not target.startswith("/"):  # an absolute URL or '*': this is no forward proxy
            raise Refusal(400, wire.bad_request(f"the request target must be a path, not {target[:100]!r}"), True)
        if wire.engine_only(target):  # /sleep, /wake_up, /collective_rpc...: the controller's, not a client's
            raise Refusal(404, wire.not_forwarded(target))
        body = await self.read_body(request)
        if request.method == "GET" and self.rooms.named and target.startswith("/v1/models"):
            return self.list_models(target)
        room = self.rooms.sole  # one model: no look at the body for it
        # With tenants the engines get the deployment's key in place of the user's.
        headers = wire.forwarded_headers(request.headers.items(), self.engine_auth if tenant is not None else None)
        # With tenants, streams carry their token ids (migration.prepare) so that their usage is counted.
        migrates = (self.settings.migrations > 0 or tenant is not None) and request.method == "POST"
        parse = body and (room is None or room.prefix or migrates or tenant is not None)
        data = body_json(body, request.headers.get("Content-Type")) if parse and body is not None else None
        if room is None:
            try:
                room = self.rooms.for_request(data)
            except NoRoom as no:
                raise Refusal(no.status, no.body) from None
        if tenant is not None:
            body, data = self.admit_tenant(request, room, tenant, target, body, data)
        affinity = None
        if room.prefix:  # prompts are tokenized only while some engine's KV events are followed
            affinity = wire.request_affinity(request.headers, data, room.tokenizer if room.pool.exact else None)
        migratable = None
        if migrates and data is not None:  # a stream that may continue elsewhere asks for its token ids
            prepared = prepare(target, body, data)
            body, migratable = prepared.body, prepared.request
        project, user = (tenant.project or "-", tenant.key_id) if tenant is not None else ("", "")
        async with room.admission.turn(affinity, project, user) as ticket:
            return await self.forward(request, room, target, body, headers, affinity, migratable, ticket)

    def admit_tenant(self, request: web.BaseRequest, room: Room, tenant: Tenant, target: str, body: bytes | None,
                     data: dict | None) -> tuple[bytes | None, dict | None]:
        """The tenant's model and limits checked (a Refusal if not), the request counted against its key, and
        its Visit kept on the request for its usage row. Returns the body (and JSON) to send: with max_tokens
        set where the key caps it and the request set none."""
        tenants = self.tenants
        assert tenants is not None, "a tenant is only ever identified by self.tenants (answer)"
        named = data.get("model") if data is not None else None
        # A body that names no model is served by the room's engines' own (vLLM's default): that is the
        # model a key for some models is checked against, and the one its usage row names.
        model = named if isinstance(named, str) else room.name or None
        if tenant.models is not None and request.method == "POST" and model not in tenant.models:  # allows_model
            raise Refusal(403, model_refusal(model, tenant.models, named=isinstance(named, str)))
        now = time.time()
        hit = tenants.admit(tenant, data, now)  # counted against its key when it passes
        if hit is not None:
            status, answer, _ = limit_refusal(hit)
            raise Refusal(status, answer, retry_after=hit.retry_after_s if hit.retry_after_s is not None else False)
        cap = missing_max_tokens(tenant.limits, data) if tenant.capped else None
        if cap is not None and data is not None:  # a cap only for a request's JSON
            data = {**data, "max_tokens": cap}
            body = json.dumps(data).encode()
        request[VISIT] = Visit(tenant, target.split("?", 1)[0], model, now, time.monotonic())
        return body, data

    async def read_body(self, request: web.BaseRequest) -> bytes | None:
        if not request.body_exists:
            return None
        limit = self.settings.max_body_bytes
        if (request.content_length or 0) > limit:
            raise Refusal(413, wire.too_large(limit), close=True)
        if request.content.is_eof():  # all of it came with the headers (most requests): no timer needed
            return await request.read()
        if request.headers.get("Expect", "").lower() == "100-continue":  # only now: refusals come first
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                return await request.read()
        except TimeoutError:
            raise Refusal(408, wire.body_timeout(self.settings.body_timeout_s), close=True) from None
        except web.HTTPRequestEntityTooLarge:  # chunked, without a length up front
            raise Refusal(413, wire.too_large(limit), close=True) from None

    async def forward(self, request: web.BaseRequest, room: Room, target: str, body: bytes | None,
                      headers: dict[str, str], affinity: Affinity | None,
                      migratable: Migratable | None = None, ticket: Ticket | None = None) -> web.StreamResponse:
        tried: tuple[Backend, ...] = ()
        hold_until = None
        resent = 0
        while True:
            backend = self.choose(room.pool, room.policy, affinity, time.monotonic(), tried)
            waking = room.sleep.waking  # None: the model does not sleep
            if backend is None and waking is not None and not room.pool.active:  # asleep or waking: waking.py
                hold_until = hold_until or time.monotonic() + waking.wait_s
                backend = await wait_for_wake(self, request, room, affinity, body, hold_until, waking_refusal)
                if not isinstance(backend, Backend):  # a stream whose wait ran out, answered
                    return backend
            elif backend is None:
                hold_until = hold_until or time.monotonic() + room.hold_s  # one hold per request
                backend = await self.hold(room, affinity, hold_until)
            tried += (backend,)
            backend.in_flight += 1
            backend.requests += 1
            lease = Lease(backend)  # a stream that moves takes it along
            try:
                return await self.relay(request, room, lease, target, body, headers, migratable, ticket)
            except AttemptFailed as failed:
                decision = wire.after_failure(failed.failure, len(tried), self.settings.tries, resent,
                                              self.settings.resends)
                if decision.mark_failed:
                    backend.failed_until = time.monotonic() + self.settings.failed_s
                    backend.failures += 1
                if not decision.retry:
                    raise self.gave_up(failed) from None
                self.stats.retries += 1
                if failed.failure is wire.Failure.DISCONNECT:
                    resent += 1
                    self.stats.resends += 1
            finally:
                lease.release(room.pool)

    def gave_up(self, failed: AttemptFailed) -> Refusal:
        if failed.failure is wire.Failure.TIMEOUT:
            return Refusal(504, wire.replica_timeout(self.settings.first_byte_timeout_s))
        return Refusal(502, wire.bad_gateway(failed.detail[:200]), retry_after=True)

    async def hold(self, room: Room, affinity: Affinity | None, until: float) -> Backend:
        """Wait until a backend of the room can take the request (added, or a failed one's pause over), or
        503; 404 when the model leaves meanwhile."""
        self.stats.holds += 1
        self.stats.held += 1
        room.held += 1
        try:
            while True:
                if room.closed:
                    raise Refusal(404, gone_model(room.name))
                now = time.monotonic()
                wait = wire.hold_wait(now, until, room.pool.next_recovery(now))
                if wait is None:
                    self.stats.hold_timeouts += 1
                    raise Refusal(503, wire.no_backend(room.hold_s), retry_after=True)
                changed = room.changed
                try:
                    async with asyncio.timeout(wait):
                        await changed.wait()
                except TimeoutError:
                    pass
                if room.closed:
                    raise Refusal(404, gone_model(room.name))
                backend = self.choose(room.pool, room.policy, affinity, time.monotonic())
                if backend is not None:
                    return backend
        finally:
            self.stats.held -= 1
            room.held -= 1

    async def relay(self, request: web.BaseRequest, room: Room, lease: Lease, target: str, body: bytes | None,
                    headers: dict[str, str], migratable: Migratable | None = None,
                    ticket: Ticket | None = None) -> web.StreamResponse:
        """One attempt. AttemptFailed while nothing has gone to the client; after that a stream that may
        migrate continues elsewhere (streams.Stream), and an error otherwise ends the client's connection
        (it sees the response cut: an engine that died mid-stream). Whatever ends the
        attempt early, the client leaving included (a cancellation), closes the engine's connection:
        vLLM aborts a request whose connection closed, and keeps generating one whose did not."""
        backend, upstream = lease.backend, None
        session = self.session
        assert session is not None, "open() makes the session before any request"
        try:  # nothing has reached the client yet: a failure here may be tried on another backend
            async with asyncio.timeout(self.settings.first_byte_timeout_s):
                upstream = await session.request(request.method, self.upstream_url(backend.url, target),
                                                      data=body, headers=headers, allow_redirects=False)
                whole = self.read_whole(request, upstream)
                # A stream commits to this backend only once its first chunk is here: vLLM answers 200 at
                # once for a streamed request, and an engine that dies before its first token is tried elsewhere.
                first = await (upstream.read() if whole else upstream.content.readany())
        except BaseException as exc:
            if upstream is not None:
                upstream.close()
            if isinstance(exc, Exception):  # classified; a cancellation (the client left) goes on up
                raise attempt_failed(exc) from exc
            raise
        out_headers = CIMultiDict(wire.returned_headers(upstream.headers.items()))
        visit = request.get(VISIT)
        waiting = waiting_stream(request)  # a stream begun while its model woke: the answer goes on in it
        if whole:
            upstream.release()
            if visit is not None:
                visit.whole_answer(first)
            if waiting is not None:
                return await answer_in_stream(waiting, upstream.status, first)
            return web.Response(status=upstream.status, body=first, headers=out_headers)
        if visit is not None:
            visit.first_byte = time.monotonic()
        if migratable is not None and upstream.status == 200:
            response = waiting or RelayedStream(status=upstream.status, headers=out_headers)
            if waiting is None:
                request[RELAYED] = response
                await response.prepare(request)
            stream = Stream(self, room, response, lease, migratable, headers, ticket)
            try:
                await stream.run(upstream, first)
            finally:
                if visit is not None:
                    visit.stream_counts(*stream.token_counts(), stream.migrations > 0)
            await response.write_eof()
            return response
        done = False
        try:
            response = waiting or RelayedStream(status=upstream.status, headers=out_headers)
            if waiting is None:
                request[RELAYED] = response
                await response.prepare(request)
            chunk, silence = first, self.settings.read_timeout_s
            while chunk:
                await response.write(chunk)
                async with asyncio.timeout(silence):
                    chunk = await upstream.content.readany()
            done = True
        except (aiohttp.ClientError, TimeoutError) as exc:  # the stream broke after it began
            self.stats.broken_streams += 1
            raise ConnectionError(f"the stream from {backend.url} broke: {type(exc).__name__}") from exc
        finally:
            if done:
                upstream.release()
            else:  # closing the connection tells the engine to abort the request (client gone, or broken)
                upstream.close()
        await response.write_eof()
        return response

    def read_whole(self, request: web.BaseRequest, upstream: aiohttp.ClientResponse) -> bool:
        """Whether the answer is read whole (a length within max_buffer_bytes, or no body): it can still go
        to another backend if the connection drops."""
        if request.method == "HEAD" or upstream.status in (204, 304):
            return True
        length = upstream.content_length
        return length is not None and length <= self.settings.max_buffer_bytes

    def upstream_url(self, backend: str, target: str) -> URL:
        url = self.urls.get((backend, target))
        if url is None:
            if len(self.urls) >= URL_CACHE_SIZE:  # query strings make targets unbounded: start over
                self.urls.clear()
            url = self.urls[(backend, target)] = URL(backend + target, encoded=True)
        return url

    def log_migration(self, room: Room, migration: Migration) -> None:
        """A stream moved (or could not): kept for its model's GET /migrations (its controller's decisions) and
        logged."""
        room.migration_log.append(migration)
        where = f"to {migration.to}" if migration.to else f"not moved: {migration.reason}"
        log.info("migration (%s) of a %s stream from %s after %d token(s): %s", migration.cause, migration.kind,
                 migration.source, migration.tokens, where)


def waking_refusal(status: int, body: bytes, retry_after: int) -> Refusal:
    return Refusal(status, body, retry_after=retry_after if status == 503 else False)


def body_json(body: bytes, content_type: str | None) -> dict | None:
    """The body's JSON object (None: it has none, for the engine to refuse or read its own way). A body that
    vLLM 0.32 would read as JSON but cannot decode (not UTF-8, or nested past Python's recursion limit) is
    refused here: vLLM answers it a 400 outside OpenAI's error shape ({"detail": ...}), and parsing it here
    raised RecursionError, a 500. Any other body is the engine's to judge, as before."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, RecursionError) as exc:
        if not wire.json_content(content_type):  # the engine does not read it as JSON (a file upload): its answer
            return None
        reason = "is not valid UTF-8" if isinstance(exc, UnicodeDecodeError) else "nests its JSON too deeply"
        raise Refusal(400, wire.invalid_body(f"the request body {reason}")) from None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def attempt_failed(exc: BaseException) -> AttemptFailed:
    """What kind of failure an aiohttp client error is (wire.after_failure decides what follows)."""
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError)):
        return AttemptFailed(wire.Failure.CONNECT, detail)
    if isinstance(exc, (aiohttp.SocketTimeoutError, TimeoutError)):
        return AttemptFailed(wire.Failure.TIMEOUT, detail)
    if isinstance(exc, aiohttp.ClientError):  # disconnected, reset, a payload cut, a malformed answer
        return AttemptFailed(wire.Failure.DISCONNECT, detail)
    raise exc


async def serve(settings: Settings, key: str | None, client_sock: socket.socket, admin_sock: socket.socket,
                admin_path: Path | None = None, peers=None) -> None:
    """One process serving the client port (alone, or as one of several workers: then its admin socket is
    its supervisor's line to it, and peers carry routing knowledge between the workers)."""
    tenancy = TenancySettings.read(settings.tenancy) if settings.tenancy else None
    tenants = tenant_view(tenancy, key) if tenancy is not None else None
    plane = DataPlane(settings, key, tenants)
    await plane.open()
    if tenants is not None:  # users' keys known before the first request
        tenants.start(asyncio.get_running_loop())
        await asyncio.to_thread(tenants.loaded.wait, 30)
    clients = web.ServerRunner(ClientServer(plane), handle_signals=False, shutdown_timeout=settings.grace_s)
    admin = web.AppRunner(admin_app(plane), handle_signals=False, access_log=None, shutdown_timeout=1.0)
    await clients.setup()
    await admin.setup()
    await web.SockSite(clients, client_sock, backlog=1024).start()
    await web.SockSite(admin, admin_sock).start()
    if peers is not None:  # other workers share this port: each choice hears theirs and tells them
        plane.choose = peers.choosing(plane.choose)
        peers.listen(asyncio.get_running_loop(), plane.rooms.for_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if peers is None:
        log.info("serving on %s:%s (model %s), policy %s, hold %g s, at most %d connections; admin socket %s",
                 settings.host, settings.port, settings.model or "any", settings.policy, settings.hold_s,
                 settings.max_connections, settings.admin_socket)
    await stop.wait()
    # Stop listening, let requests in flight finish (up to grace_s), then close everything.
    await clients.cleanup()
    await admin.cleanup()
    await plane.close()
    if tenants is not None:  # the usage rows not yet written
        await asyncio.to_thread(tenants.stop)
    remove_unix_socket(admin_path or settings.admin_socket)
    if peers is None:
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(sys.argv[1:] if argv is None else argv, __doc__.splitlines()[0])
    configure_process_logging()  # stderr: router.log (control.plane_client.Router)
    try:
        key = read_key_file(settings.key_file) if settings.key_file else None
        client_socks = client_sockets(settings.host, settings.port, settings.workers)
        admin_sock = bind_admin_socket(settings.admin_socket)
    except (OSError, ValueError, HpcserveError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    if key is None:
        log.warning("no --key-file: the endpoint answers anyone who can reach it")
    import setproctitle

    # `ps` names it, with what tells two endpoints' routers apart on one login node.
    setproctitle.setproctitle(f"{PROCESS_TITLE} --port {settings.port} --admin-socket {settings.admin_socket}")
    if settings.workers > 1:
        return supervise(settings, key, client_socks, admin_sock, serve)
    import uvloop

    uvloop.run(serve(settings, key, client_socks[0], admin_sock))
    return 0


if __name__ == "__main__":
    sys.exit(main())
