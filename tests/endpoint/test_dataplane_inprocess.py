"""The data plane's forwarding in this process: a DataPlane served as serve() serves it (its ClientServer on
the client port, its admin app on an owner-only Unix socket) in front of stand-in engines
(testing.standin.make_app), all on aiohttp's test servers in one event loop. The backends are set as the
controller sets them (PUT /backends on the admin socket). The same behaviours between real processes:
test_router.py; these take milliseconds each."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestServer

from hpcserve.core.net import unix_socket_path
from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane.admin import admin_app
from hpcserve.endpoint.dataplane.plane import DataPlane
from hpcserve.endpoint.dataplane.server import ClientServer, bind_admin_socket
from hpcserve.endpoint.dataplane.settings import Settings
from hpcserve.endpoint.protocol import BACKENDS, BackendSpec, DesiredBackends
from hpcserve.testing.standin import make_app

KEY = "in-process-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HOLD_S = 0.3
BODY = {"model": "stub", "prompt": "Hello", "max_tokens": 3}


class ClientPort(BaseTestServer):
    """The data plane's client port as serve() builds it: aiohttp's low-level server with the plane's
    handler and connection cap (server.ClientServer), on a test server's socket."""

    def __init__(self, plane: DataPlane):
        super().__init__()
        self.plane = plane

    async def _make_runner(self, **_kwargs) -> web.ServerRunner:
        return web.ServerRunner(ClientServer(self.plane), handle_signals=False)


@dataclass
class Served:
    """One data plane in this process, as a client and its controller reach it."""

    plane: DataPlane
    url: str  # the client port
    clients: aiohttp.ClientSession
    admin: aiohttp.ClientSession  # over the admin socket

    async def set_backends(self, urls: list[str]) -> dict:
        """What the controller's Router.set_backends sends: the whole desired set."""
        desired = DesiredBackends([BackendSpec(url, capacity=4) for url in urls]).to_json()
        async with self.admin.put(f"http://plane{BACKENDS}", json=desired) as answer:
            assert answer.status == 200, await answer.text()
            return await answer.json()

    async def backends(self) -> dict[str, dict]:
        async with self.admin.get(f"http://plane{BACKENDS}") as answer:
            return {b["url"]: b for b in (await answer.json())["backends"]}

    async def complete(self, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
        """(status, headers, body) of one POST /v1/completions; the key unless headers say otherwise."""
        async with self.clients.post(f"{self.url}/v1/completions", json=body,
                                     headers=AUTH if headers is None else headers) as answer:
            return answer.status, dict(answer.headers), await answer.read()


@asynccontextmanager
async def data_plane(folder: Path, hold_s: float = HOLD_S) -> AsyncIterator[Served]:
    socket_path = unix_socket_path(folder / "admin" / "admin.sock")
    settings = Settings("127.0.0.1", 0, None, socket_path, policy=Routing.ROUND_ROBIN, hold_s=hold_s)
    plane = DataPlane(settings, KEY)
    await plane.open()
    admin = web.AppRunner(admin_app(plane), handle_signals=False, access_log=None)
    await admin.setup()
    await web.SockSite(admin, bind_admin_socket(socket_path)).start()
    try:
        async with ClientPort(plane) as port, aiohttp.ClientSession() as clients, \
                aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket_path))) as admin_session:
            yield Served(plane, str(port.make_url("")).rstrip("/"), clients, admin_session)
    finally:
        await admin.cleanup()
        await plane.close()
        socket_path.unlink(missing_ok=True)  # as serve() does: it may lie outside tmp_path (unix_socket_path)


@asynccontextmanager
async def engines(*names: str) -> AsyncIterator[dict[str, str]]:
    """Stand-in engines that want the endpoint's key, as vLLM behind hpcserve does: name -> URL."""
    servers = [TestServer(make_app(name, api_key=KEY)) for name in names]
    for server in servers:
        await server.start_server()
    try:
        yield {name: str(server.make_url("")).rstrip("/") for name, server in zip(names, servers)}
    finally:
        for server in servers:
            await server.close()


def refusing_url() -> tuple[socket.socket, str]:
    """A port that refuses connections: bound (so nobody else takes it) but not listening."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def sse_texts(body: bytes) -> list[str]:
    """The token texts of an SSE completion stream, checked to end with [DONE]."""
    events = [line[len(b"data: "):] for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert events and events[-1] == b"[DONE]", body[-200:]
    return [choice["text"] for event in events[:-1] for choice in json.loads(event)["choices"]]


def test_completions_whole_and_streamed_are_forwarded_with_the_engines_answer(tmp_path):
    async def check() -> None:
        async with engines("a") as urls, data_plane(tmp_path) as served:
            await served.set_backends([urls["a"]])
            status, headers, body = await served.complete(BODY)
            assert status == 200, body
            answer = json.loads(body)
            assert answer["system_fingerprint"] == "a" and answer["choices"][0]["text"] == "xxx"
            assert headers["x-backend"] == "a"  # the engine's headers passed on
            status, headers, body = await served.complete({**BODY, "stream": True})
            assert status == 200 and headers["Content-Type"].startswith("text/event-stream"), body
            assert sse_texts(body) == ["x", "x", "x"]
            assert served.plane.stats.retries == 0

    asyncio.run(check())


def test_a_request_without_the_key_gets_401_in_openai_shape_and_reaches_no_engine(tmp_path):
    async def check() -> None:
        async with engines("a") as urls, data_plane(tmp_path) as served:
            await served.set_backends([urls["a"]])
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                status, _, body = await served.complete(BODY, headers)
                error = json.loads(body)["error"]
                assert status == 401 and error["code"] == "invalid_api_key", body
                assert "Authorization: Bearer KEY" in error["message"]
            assert (await served.backends())[urls["a"]]["requests"] == 0

    asyncio.run(check())


def test_a_backend_that_refuses_the_connection_is_retried_on_the_other_and_set_aside(tmp_path):
    dead, dead_url = refusing_url()

    async def check() -> None:
        async with engines("a") as urls, data_plane(tmp_path) as served:
            await served.set_backends([dead_url, urls["a"]])
            answers = [await served.complete(BODY) for _ in range(3)]  # in turn: one of them goes to dead first
            assert [(status, headers["x-backend"]) for status, headers, _ in answers] == [(200, "a")] * 3
            backends = await served.backends()
            assert backends[dead_url]["failures"] == 1 and backends[dead_url]["failed"]
            assert served.plane.stats.retries == 1  # the others skipped dead while it is set aside

    with dead:
        asyncio.run(check())


def test_with_no_backend_a_request_is_held_then_refused_503_with_retry_after(tmp_path):
    async def check() -> None:
        async with data_plane(tmp_path) as served:
            started = time.monotonic()
            status, headers, body = await served.complete(BODY)
            waited = time.monotonic() - started
            assert status == 503 and json.loads(body)["error"]["code"] == "no_replica", body
            assert "Retry-After" in headers
            assert HOLD_S <= waited < HOLD_S + 1.0, waited

    asyncio.run(check())


def test_a_request_held_while_the_pool_is_empty_goes_to_a_backend_added_meanwhile(tmp_path):
    async def check() -> None:
        async with engines("a") as urls, data_plane(tmp_path, hold_s=30.0) as served:
            request = asyncio.create_task(served.complete(BODY))
            while served.plane.stats.held == 0:  # the request waits in the data plane now
                await asyncio.sleep(0.005)
            await served.set_backends([urls["a"]])
            status, headers, _ = await asyncio.wait_for(request, 5.0)  # at once, not at the hold's end
            assert (status, headers["x-backend"]) == (200, "a")

    asyncio.run(check())
