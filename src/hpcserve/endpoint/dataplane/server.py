"""The HTTP and socket plumbing around the data plane (dataplane.DataPlane): aiohttp's low-level server with
the data plane's own answers to malformed requests and a cap on open connections, the owner-only admin
socket, the client port's listening sockets, and the Prometheus page. Shared by a lone data plane and by
the supervisor of several workers (workers.py)."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import struct
from pathlib import Path
from typing import Any, Protocol, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CollectorRegistry, generate_latest

from hpcserve.core.folders import private_dir
from hpcserve.endpoint.dataplane import wire
from hpcserve.endpoint.dataplane.metrics import Collector, Stats
from hpcserve.endpoint.dataplane.sse import DONE_MARK

# After a refusal the rest of a request is read and dropped this long (so the client gets the answer, not
# a reset while it still sends), then the connection closes: aiohttp's 10 s would let slow clients linger.
LINGER_S = 1.0
FDS_PER_CONNECTION = 2  # the client's connection and the one to the engine


def metrics_response(collector: Collector) -> web.Response:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return web.Response(body=generate_latest(registry), content_type="text/plain", charset="utf-8")


class Plane(Protocol):
    """What the server reads of the dataplane.DataPlane it serves (not imported here: it imports this module)."""

    stats: Stats


class ClientProtocol(RequestHandler):
    """aiohttp's connection handler, with the data plane's own answer to a malformed request (JSON, and
    no log line per bad client: they are counted)."""

    plane: Plane

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
        stream = cast(asyncio.Transport, transport)  # a TCP connection's
        stream.write(self.answer)
        stream.close()


def request_key(name: str, kind: type) -> Any:
    """A key of a request's own storage: aiohttp's typed RequestKey where it has one (3.14 on: a plain string
    key warns there), else the name itself (the GPU images' vLLM may bring an older aiohttp)."""
    typed = getattr(web, "RequestKey", None)
    return typed(name, kind) if typed is not None else name


class RelayedStream(web.StreamResponse):
    """A streamed answer that knows when the client has it whole: `data: [DONE]` written. Most clients stop
    reading there and hang up before the body's last chunk (vLLM's server sends it a little later); the
    data plane then stops the request (handler_cancellation), but counts it answered, not 499."""

    whole = False

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await super().write(data)
        if DONE_MARK in data:
            self.whole = True


RELAYED = request_key("hpcserve.relayed", RelayedStream)  # where the request keeps its streamed answer


def answered_status(request: web.BaseRequest) -> int | None:
    """The status of a streamed answer the client already had whole, else None."""
    relayed = request.get(RELAYED)
    return relayed.status if relayed is not None and relayed.whole else None


class ClientServer(web.Server):
    """aiohttp's low-level server (no router, no middleware: the data plane routes itself) with a cap on
    open connections."""

    def __init__(self, plane, **kwargs):
        """plane: a dataplane.DataPlane (its handle, settings and stats)."""
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
        try:
            sock.bind(str(path))
        except FileNotFoundError:  # another deployment's `down` removed the shared, empty folder just now
            private_dir(path.parent)
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


def client_sockets(host: str, port: int, workers: int) -> list[socket.socket]:
    """The client port's listening sockets, one per worker: with several, each is bound with SO_REUSEPORT
    and the kernel spreads new connections over them (Linux lets only sockets of the same user share a
    port so: another user cannot bind beside them and take a share of the clients)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return [socket.create_server((host, port), family=family, backlog=1024, reuse_port=workers > 1)
            for _ in range(workers)]
