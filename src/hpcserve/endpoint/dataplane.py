"""The endpoint's data plane: one OpenAI URL in front of the replicas, in a process of its own.

    python -m hpcserve.endpoint.dataplane --host H --port P --key-file F --admin-socket S
                                          [--policy least_loaded|round_robin|prefix] [--hold-s 60]

Clients (H:P). Every route goes to a replica that balance.choose picks (completions, chat, models,
embeddings, tokenize, ...): the body as bytes, never parsed; a response with a length passed whole, any
other (SSE streams) chunk by chunk as it arrives; status and headers kept. Each request must carry
`Authorization: Bearer KEY` (compared in constant time, no cache of tokens); a missing or wrong key gets
401 with an OpenAI-style JSON body that says where the key is (wire.UNAUTHORIZED). GET /health alone is
open and answers 200 from here: it says that this process lives and nothing else (no replica, no count),
reaches no replica and changes nothing, so a caller without the key learns what a TCP connect tells.
Admin (the Unix socket S: mode 0600 in an owner-only folder, and the peer's uid checked): only the user
who started the endpoint can change what it serves. Never on the client port (404 there).
    GET /backends      the backends, their settings, requests in flight through here, failures, held requests
    PUT /backends      the whole desired set [{url, capacity, saturated}] (idempotent; the controller's list)
    GET /metrics       this process's Prometheus metrics
Failures. A connection error before any response byte reached the client: the request goes to another
backend (at most --tries attempts); a refused connection also keeps that backend out for --failed-s.
Nothing is retried once the client got a byte. An engine's 5xx is passed on and changes nothing else.
While no backend can take a request (the pool empty during a handover, the one replica being replaced),
requests are held up to --hold-s and sent on as soon as one is added; then 503 JSON with Retry-After.
Bounds: body size (413), header and body read times against slow clients, open connections (503 at
accept), and a malformed request gets a JSON 4xx while the server serves on.
`ps` shows it as "hpcserve-router --port P ..."; router.Router starts, finds and stops it by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import resource
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from yarl import URL

from hpcserve.core.errors import HpcserveError
from hpcserve.core.folders import private_dir
from hpcserve.core.keys import read_key_file
from hpcserve.core.statuses import Routing
from hpcserve.endpoint import wire
from hpcserve.endpoint.balance import Backend, BackendSpec, Pool, choose
from hpcserve.endpoint.wire import MODULE, PROCESS_TITLE

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# After a refusal the rest of a request is read and dropped this long (so the client gets the answer, not
# a reset while it still sends), then the connection closes: aiohttp's 10 s would let slow clients linger.
LINGER_S = 1.0
# Engines (uvicorn) close idle keep-alive connections after 5 s; closing ours first spares requests the
# race of a connection closed under them.
UPSTREAM_KEEPALIVE_S = 4.0
FDS_PER_CONNECTION = 2  # the client's connection and the one to the engine
URL_CACHE_SIZE = 4096
CLIENT_CLOSED = 499  # nginx's code for a client that went away before the answer: in the metrics only


@dataclass(frozen=True)
class Settings:
    host: str
    port: int
    key_file: Path | None
    admin_socket: Path
    policy: Routing = Routing.LEAST_LOADED
    hold_s: float = 60.0
    tries: int = 3  # attempts per request on connection errors
    failed_s: float = 5.0  # a backend that refused a connection is skipped this long
    max_body_bytes: int = 64 * 2**20
    max_connections: int = 2048
    header_timeout_s: float = 30.0  # also how long an idle client connection stays open
    body_timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 1800.0  # an engine silent this long (no header, no chunk) fails the request
    grace_s: float = 5.0  # at SIGTERM: requests in flight may finish this long


class Refusal(Exception):
    """An answer of the data plane's own (JSON), raised where the request cannot go on."""

    def __init__(self, status: int, body: bytes, close: bool = False, retry_after: bool = False):
        super().__init__(status)
        self.status, self.body, self.close, self.retry_after = status, body, close, retry_after

    def response(self) -> web.Response:
        headers = {"Retry-After": str(wire.RETRY_AFTER_S)} if self.retry_after else None
        response = web.Response(status=self.status, body=self.body, content_type="application/json", headers=headers)
        if self.close:  # the rest of the request (a body too large, too slow) is never read
            response.force_close()
        return response


class AttemptFailed(Exception):
    def __init__(self, failure: wire.Failure, detail: str):
        super().__init__(detail)
        self.failure, self.detail = failure, detail


@dataclass
class Stats:
    """Plain counters on the hot path; turned into Prometheus metrics only when scraped (Collector)."""

    codes: dict[int, int] = field(default_factory=dict)
    buckets: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    duration_sum: float = 0.0
    holds: int = 0
    hold_timeouts: int = 0
    held: int = 0
    retries: int = 0
    broken_streams: int = 0
    malformed: int = 0
    refused_connections: int = 0

    def done(self, status: int, seconds: float) -> None:
        self.codes[status] = self.codes.get(status, 0) + 1
        self.buckets[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.duration_sum += seconds


class DataPlane:
    def __init__(self, settings: Settings, key: str | None):
        self.settings = settings
        self.expected = wire.expected_authorization(key)
        self.pool = Pool()
        self.stats = Stats()
        self.changed = asyncio.Event()  # replaced after every membership change: held requests wake
        self.session: aiohttp.ClientSession | None = None
        self.prefix = settings.policy is Routing.PREFIX
        self.urls: dict[tuple[str, str], URL] = {}  # (backend, path) -> parsed URL: a few paths are most requests

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.settings.max_connections, limit_per_host=0,
                                         keepalive_timeout=UPSTREAM_KEEPALIVE_S, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout_s,
                                        sock_read=self.settings.read_timeout_s)
        # No proxies from the environment (the engines are reached directly), no cookies, bodies as bytes.
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False,
                                             auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                                             skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

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
            self.stats.done(status, time.monotonic() - started)

    async def answer(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.raw_path == "/health" and request.method == "GET":
            return web.Response()
        if not wire.key_matches(request.headers.get("Authorization"), self.expected):
            raise Refusal(401, wire.UNAUTHORIZED)
        target = request.raw_path
        if not target.startswith("/"):  # an absolute URL or '*': this is no forward proxy
            raise Refusal(400, wire.bad_request(f"the request target must be a path, not {target[:100]!r}"), True)
        body = await self.read_body(request)
        headers = wire.forwarded_headers(request.headers.items())
        key = wire.affinity_key(request.headers, body) if self.prefix else None
        return await self.forward(request, target, body, headers, key)

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

    async def forward(self, request: web.BaseRequest, target: str, body: bytes | None, headers: dict[str, str],
                      key: bytes | None) -> web.StreamResponse:
        tried: tuple[Backend, ...] = ()
        hold_until = None
        while True:
            backend = choose(self.pool, self.settings.policy, key, time.monotonic(), tried)
            if backend is None:
                hold_until = hold_until or time.monotonic() + self.settings.hold_s  # one hold per request
                backend = await self.hold(key, hold_until)
            tried += (backend,)
            backend.in_flight += 1
            backend.requests += 1
            try:
                return await self.relay(request, backend, target, body, headers)
            except AttemptFailed as failed:
                decision = wire.after_failure(failed.failure, len(tried), self.settings.tries)
                if decision.mark_failed:
                    backend.failed_until = time.monotonic() + self.settings.failed_s
                    backend.failures += 1
                if not decision.retry:
                    raise self.gave_up(failed) from None
                self.stats.retries += 1
            finally:
                self.pool.release(backend)

    def gave_up(self, failed: AttemptFailed) -> Refusal:
        if failed.failure is wire.Failure.TIMEOUT:
            return Refusal(504, wire.replica_timeout(self.settings.read_timeout_s))
        return Refusal(502, wire.bad_gateway(failed.detail[:200]), retry_after=True)

    async def hold(self, key: bytes | None, until: float) -> Backend:
        """Wait until a backend can take the request (added, or a failed one's pause over), or 503."""
        self.stats.holds += 1
        self.stats.held += 1
        try:
            while True:
                now = time.monotonic()
                wait = wire.hold_wait(now, until, self.pool.next_recovery(now))
                if wait is None:
                    self.stats.hold_timeouts += 1
                    raise Refusal(503, wire.no_backend(self.settings.hold_s), retry_after=True)
                changed = self.changed
                try:
                    async with asyncio.timeout(wait):
                        await changed.wait()
                except TimeoutError:
                    pass
                backend = choose(self.pool, self.settings.policy, key, time.monotonic())
                if backend is not None:
                    return backend
        finally:
            self.stats.held -= 1

    async def relay(self, request: web.BaseRequest, backend: Backend, target: str, body: bytes | None,
                    headers: dict[str, str]) -> web.StreamResponse:
        """One attempt. AttemptFailed while nothing has gone to the client; after that an error ends the
        client's connection (it sees the response cut: an engine that died mid-stream)."""
        upstream = None
        try:  # nothing has reached the client yet: a failure here may be tried on another backend
            upstream = await self.session.request(request.method, self.upstream_url(backend.url, target), data=body,
                                                  headers=headers, allow_redirects=False)
            whole = upstream.content_length is not None or request.method == "HEAD" or upstream.status in (204, 304)
            # A stream commits to this backend only once its first chunk is here: vLLM answers 200 at once
            # for a streamed request, and an engine that dies before its first token is tried elsewhere.
            first = await (upstream.read() if whole else upstream.content.readany())
        except Exception as exc:  # noqa: BLE001 - classified; anything else is a bug and propagates
            if upstream is not None:
                upstream.close()
            raise attempt_failed(exc) from exc
        out_headers = CIMultiDict(wire.returned_headers(upstream.headers.items()))
        if whole:
            upstream.release()
            return web.Response(status=upstream.status, body=first, headers=out_headers)
        done = False
        try:
            response = web.StreamResponse(status=upstream.status, headers=out_headers)
            await response.prepare(request)
            chunk = first
            while chunk:
                await response.write(chunk)
                chunk = await upstream.content.readany()
            await response.write_eof()
            done = True
            return response
        except (aiohttp.ClientError, TimeoutError) as exc:  # the stream broke after it began
            self.stats.broken_streams += 1
            raise ConnectionError(f"the stream from {backend.url} broke: {type(exc).__name__}") from exc
        finally:
            if done:
                upstream.release()
            else:  # closing the connection tells the engine to abort the request (client gone, or broken)
                upstream.close()

    def upstream_url(self, backend: str, target: str) -> URL:
        url = self.urls.get((backend, target))
        if url is None:
            if len(self.urls) >= URL_CACHE_SIZE:  # query strings make targets unbounded: start over
                self.urls.clear()
            url = self.urls[(backend, target)] = URL(backend + target, encoded=True)
        return url

    # -------------------------------------------------------------- admin

    def backends_json(self) -> dict:
        now = time.monotonic()
        return {"policy": str(self.settings.policy), "hold_s": self.settings.hold_s, "held": self.stats.held,
                "backends": [{**BackendSpec(b.url, b.capacity, b.saturated).to_json(), "in_flight": b.in_flight,
                              "failed": b.failed_until > now, "requests": b.requests, "failures": b.failures}
                             for b in self.pool.active],
                "retired": [{"url": b.url, "in_flight": b.in_flight} for b in self.pool.retired.values()]}

    async def get_backends(self, _request: web.Request) -> web.Response:
        return web.json_response(self.backends_json())

    async def put_backends(self, request: web.Request) -> web.Response:
        try:
            data = await request.json()
            specs = [BackendSpec.from_json(item) for item in data["backends"]]
            self.pool.update(specs)
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=400)
        self.changed.set()  # held requests look again (a backend may have joined or recovered)
        self.changed = asyncio.Event()
        return web.json_response(self.backends_json())

    async def get_metrics(self, _request: web.Request) -> web.Response:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Collector(self))
        return web.Response(body=generate_latest(registry), content_type="text/plain", charset="utf-8")

    async def get_health(self, _request: web.Request) -> web.Response:
        return web.json_response({"pid": os.getpid(), "port": self.settings.port})


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


class Collector:
    """The data plane's Prometheus metrics, built from its plain counters at scrape time."""

    def __init__(self, plane: DataPlane):
        self.plane = plane

    def collect(self):
        stats, pool = self.plane.stats, self.plane.pool
        codes = CounterMetricFamily("hpcserve_router_requests", "Requests answered, by HTTP status "
                                    f"({CLIENT_CLOSED}: the client left, or the stream broke)", labels=["code"])
        for code, count in sorted(stats.codes.items()):
            codes.add_metric([str(code)], count)
        cumulative, buckets = 0, []
        for bound, count in zip((*DURATION_BUCKETS, float("inf")), stats.buckets):
            cumulative += count
            buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
        yield codes
        yield HistogramMetricFamily("hpcserve_router_request_duration_seconds", "From the request's arrival to "
                                    "the end of its response", buckets=buckets, sum_value=stats.duration_sum)
        for name, doc, value in (("holds", "Requests held while no backend could take them", stats.holds),
                                 ("hold_timeouts", "Held requests answered 503 after the hold", stats.hold_timeouts),
                                 ("retries", "Attempts sent again after a connection error", stats.retries),
                                 ("broken_streams", "Responses cut after they began (the engine or client "
                                  "went away)", stats.broken_streams),
                                 ("malformed_requests", "Requests refused as malformed HTTP", stats.malformed),
                                 ("refused_connections", "Connections refused above the cap",
                                  stats.refused_connections)):
            yield CounterMetricFamily(f"hpcserve_router_{name}", doc, value=value)
        yield GaugeMetricFamily("hpcserve_router_held", "Requests held now", value=stats.held)
        in_flight = GaugeMetricFamily("hpcserve_router_backend_in_flight", "Requests in flight to each backend "
                                      "through the data plane", labels=["backend"])
        sent = CounterMetricFamily("hpcserve_router_backend_requests", "Requests sent to each backend",
                                   labels=["backend"])
        failures = CounterMetricFamily("hpcserve_router_backend_failures", "Connection errors of each backend",
                                       labels=["backend"])
        for backend in [*pool.active, *pool.retired.values()]:
            in_flight.add_metric([backend.url], backend.in_flight)
            sent.add_metric([backend.url], backend.requests)
            failures.add_metric([backend.url], backend.failures)
        yield from (in_flight, sent, failures)


# ------------------------------------------------------------------ the HTTP server around it

class ClientProtocol(RequestHandler):
    """aiohttp's connection handler, with the data plane's own answer to a malformed request (JSON, and
    no log line per bad client: they are counted)."""

    plane: DataPlane

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # the response had begun: only closing the connection is left
            raise ConnectionError("the response had begun")
        if status >= 500:  # not a client's fault: a bug here, worth its traceback
            self.log_exception("error while answering a request", exc_info=exc)
            body = wire.error_body("hpcserve endpoint: internal error", "server_error", "internal_error")
        else:
            self.plane.stats.malformed += 1
            body = wire.bad_request((message or str(exc) or "unreadable")[:200])
        response = web.Response(status=status, body=body, content_type="application/json")
        response.force_close()
        return response


class Refuse(asyncio.Protocol):
    """A connection above the cap: a 503 with Retry-After, then closed, without reading the request."""

    def __init__(self, answer: bytes):
        self.answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.answer)
        transport.close()


class ClientServer(web.Server):
    """aiohttp's low-level server (no router, no middleware: the data plane routes itself) with a cap on
    open connections."""

    def __init__(self, plane: DataPlane, **kwargs):
        settings = plane.settings
        super().__init__(plane.handle, request_factory=self.make_request, handler_cancellation=True,
                         keepalive_timeout=settings.header_timeout_s, lingering_time=LINGER_S, access_log=None,
                         **kwargs)
        self.plane, self.open_connections = plane, 0
        self.refusal = wire.too_many_connections(settings.max_connections)

    def make_request(self, message, payload, protocol, writer, task) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task, self._loop,
                               client_max_size=self.plane.settings.max_body_bytes)

    def __call__(self):
        if self.open_connections >= self.plane.settings.max_connections:
            self.plane.stats.refused_connections += 1
            return Refuse(self.refusal)
        handler = ClientProtocol(self, loop=self._loop, **self._kwargs)
        handler.plane = self.plane
        return handler

    def connection_made(self, handler, transport) -> None:
        super().connection_made(handler, transport)
        self.open_connections += 1

    def connection_lost(self, handler, exc=None) -> None:
        super().connection_lost(handler, exc)
        self.open_connections -= 1


@web.middleware
async def owner_only(request: web.Request, handler):
    """Only the owner's processes may use the admin socket: the file's mode says so already; the peer's
    uid (SO_PEERCRED) is checked as well, for file systems that ignore a socket's mode."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and hasattr(socket, "SO_PEERCRED"):
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid != os.getuid():
            return web.json_response({"error": "only the endpoint's owner may use its admin socket"}, status=403)
    return await handler(request)


def admin_app(plane: DataPlane) -> web.Application:
    app = web.Application(middlewares=[owner_only], client_max_size=16 * 2**20)
    app.add_routes([web.get("/backends", plane.get_backends), web.put("/backends", plane.put_backends),
                    web.get("/metrics", plane.get_metrics), web.get("/health", plane.get_health)])
    return app


# ------------------------------------------------------------------ sockets and the process

def bind_admin_socket(path: Path) -> socket.socket:
    """The admin socket: its folder made owner-only, the file created 0600 (umask while binding, so it is
    never open to others for a moment). A socket another data plane still answers on is refused."""
    private_dir(path.parent)
    if path.exists() or path.is_symlink():
        if socket_answers(path):
            raise OSError(f"another process serves the admin socket {path}: is this endpoint's router running?")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(previous)
    os.chmod(path, 0o600)
    return sock


def socket_answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
            return True
        except OSError:
            return False


def connection_cap(wanted: int) -> int:
    """At most what the file descriptor limit allows (two a connection, some to spare), after raising
    the soft limit to the hard one (login nodes often start at 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = 65536 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return min(wanted, max(16, (soft - 64) // FDS_PER_CONNECTION))


async def serve(settings: Settings, key: str | None, client_sock: socket.socket, admin_sock: socket.socket) -> None:
    plane = DataPlane(settings, key)
    await plane.open()
    clients = web.ServerRunner(ClientServer(plane), handle_signals=False, shutdown_timeout=settings.grace_s)
    admin = web.AppRunner(admin_app(plane), handle_signals=False, access_log=None, shutdown_timeout=1.0)
    await clients.setup()
    await admin.setup()
    await web.SockSite(clients, client_sock, backlog=1024).start()
    await web.SockSite(admin, admin_sock).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"{PROCESS_TITLE}: serving on {settings.host}:{settings.port}, policy {settings.policy}, hold "
          f"{settings.hold_s:g} s, at most {settings.max_connections} connections; admin socket "
          f"{settings.admin_socket}", flush=True)
    await stop.wait()
    # Stop listening, let requests in flight finish (up to grace_s), then close everything.
    await clients.cleanup()
    await admin.cleanup()
    await plane.close()
    settings.admin_socket.unlink(missing_ok=True)
    print(f"{PROCESS_TITLE}: stopped", flush=True)


def parse_args(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    defaults = Settings("", 0, None, Path())
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--key-file", type=Path, help="mode-0600 file with the key; without it the endpoint is open")
    parser.add_argument("--admin-socket", type=Path, required=True)
    parser.add_argument("--policy", choices=[str(p) for p in Routing], default=str(defaults.policy))
    parser.add_argument("--hold-s", type=float, default=defaults.hold_s)
    parser.add_argument("--tries", type=int, default=defaults.tries)
    parser.add_argument("--failed-s", type=float, default=defaults.failed_s)
    parser.add_argument("--max-body-mb", type=float, default=defaults.max_body_bytes / 2**20)
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections)
    parser.add_argument("--header-timeout-s", type=float, default=defaults.header_timeout_s)
    parser.add_argument("--body-timeout-s", type=float, default=defaults.body_timeout_s)
    parser.add_argument("--read-timeout-s", type=float, default=defaults.read_timeout_s)
    args = parser.parse_args(argv)
    if args.hold_s < 0 or args.tries < 1 or args.max_connections < 1 or args.max_body_mb <= 0:
        parser.error("--hold-s must be >= 0, --tries and --max-connections >= 1, --max-body-mb > 0")
    return Settings(args.host, args.port, args.key_file, args.admin_socket.absolute(), Routing(args.policy),
                    args.hold_s, args.tries, args.failed_s, int(args.max_body_mb * 2**20),
                    connection_cap(args.max_connections), args.header_timeout_s, args.body_timeout_s,
                    defaults.connect_timeout_s, args.read_timeout_s)


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        key = read_key_file(settings.key_file) if settings.key_file else None
        family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        client_sock = socket.create_server((settings.host, settings.port), family=family, backlog=1024)
        admin_sock = bind_admin_socket(settings.admin_socket)
    except (OSError, ValueError, HpcserveError) as exc:
        print(f"{PROCESS_TITLE}: cannot start: {exc}", file=sys.stderr, flush=True)
        return 2
    if key is None:
        print(f"{PROCESS_TITLE}: no --key-file: the endpoint answers anyone who can reach it", file=sys.stderr,
              flush=True)
    import setproctitle
    import uvloop

    # `ps` names it, with what tells two endpoints' routers apart on one login node.
    setproctitle.setproctitle(f"{PROCESS_TITLE} --port {settings.port} --admin-socket {settings.admin_socket}")
    uvloop.run(serve(settings, key, client_sock, admin_sock))
    return 0


if __name__ == "__main__":
    sys.exit(main())
