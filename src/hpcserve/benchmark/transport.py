"""The load generator's httpx transport: httpcore's pool and HTTP/1.1 over a lean asyncio connection.

Why not httpx's default transport: the load generator must not be what it measures.
- httpx (via httpcore/h11) writes a request's headers and body with two send() calls. On a busy machine
  each send() to a local server can hand the CPU to the server (wakeup preemption) and the second waits
  its turn again; measured on the 2-core CI machine, that put tens of ms inside TTFT. aiohttp, which
  `vllm bench serve` uses, sends once. So writes are held until the connection's next read, which for a
  request/response exchange is exactly "headers + body, then read the response".
- httpcore's anyio backend costs a cancel scope and several context managers per read, i.e. per streamed
  token; plain asyncio streams cut the client's CPU per request by about a third (measured), and client
  CPU is server CPU lost when both share a node.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpcore
import httpx


class _AsyncioStream(httpcore.AsyncNetworkStream):
    """A connection over plain asyncio streams whose writes wait for the next read (or TLS start).

    Plain asyncio rather than httpcore's anyio backend: per streamed token that backend costs a cancel
    scope and several context managers, and this client's CPU is taken from the server it measures when
    both share a machine. Read timeouts still apply, per read, as httpx asks.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._pending: list[bytes] = []

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._pending.append(buffer)

    async def _flush(self, timeout: float | None) -> None:
        if self._pending:
            self._writer.write(b"".join(self._pending))
            self._pending.clear()
            async with _deadline(timeout, httpcore.WriteTimeout):
                await self._writer.drain()

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        await self._flush(timeout)
        async with _deadline(timeout, httpcore.ReadTimeout):
            return await self._reader.read(max_bytes)

    async def aclose(self) -> None:
        self._writer.close()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        await self._flush(timeout)
        async with _deadline(timeout, httpcore.ConnectTimeout):
            await self._writer.start_tls(ssl_context, server_hostname=server_hostname)
        return self

    def get_extra_info(self, info: str) -> Any:
        sock = self._writer.get_extra_info("socket")
        if info == "is_readable":  # asked before reusing a pooled connection: readable means closed by the server
            return _readable(sock)
        return {"ssl_object": self._writer.get_extra_info("ssl_object"), "socket": sock,
                "client_addr": self._writer.get_extra_info("sockname"),
                "server_addr": self._writer.get_extra_info("peername")}.get(info)


def _readable(sock: Any) -> bool:
    """An idle pooled connection with bytes to read was closed (or broken) by the server: don't reuse it."""
    if sock is None or sock.fileno() < 0:
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


@contextlib.asynccontextmanager
async def _deadline(timeout: float | None, error: type[Exception]):
    if timeout is None:
        yield
        return
    try:
        async with asyncio.timeout(timeout):
            yield
    except TimeoutError:
        raise error(f"no progress for {timeout:g} s") from None


class _AsyncioBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        async with _deadline(timeout, httpcore.ConnectTimeout):
            try:
                reader, writer = await asyncio.open_connection(
                    host, port, local_addr=(local_address, 0) if local_address else None)
            except OSError as exc:
                raise httpcore.ConnectError(f"{host}:{port}: {exc}") from None
        return _AsyncioStream(reader, writer)  # asyncio sets TCP_NODELAY on TCP sockets

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        async with _deadline(timeout, httpcore.ConnectTimeout):
            reader, writer = await asyncio.open_unix_connection(path)
        return _AsyncioStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _ResponseBody(httpx.AsyncByteStream):
    def __init__(self, stream: Any):
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._stream:
            yield part

    async def aclose(self) -> None:
        await self._stream.aclose()


class LeanTransport(httpx.AsyncBaseTransport):
    """httpcore's connection pool over lean asyncio connections. Timeouts come from the request as usual;
    failures surface as httpcore's exceptions (same names as httpx's), which the load generator records."""

    def __init__(self, limits: httpx.Limits):
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry, network_backend=_AsyncioBackend())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host, port=request.url.port,
                           target=request.url.raw_path)
        core_request = httpcore.Request(method=request.method, url=url, headers=request.headers.raw,
                                        content=request.stream, extensions=request.extensions)
        response = await self._pool.handle_async_request(core_request)
        return httpx.Response(status_code=response.status, headers=response.headers,
                              stream=_ResponseBody(response.stream), extensions=response.extensions)

    async def aclose(self) -> None:
        await self._pool.aclose()
