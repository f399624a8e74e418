"""An httpx transport that sends each HTTP request in one write.

httpx (via httpcore/h11) writes a request's headers and its body with two send() calls. On a busy
machine every send() to a local server can hand the CPU to the server process (wakeup preemption),
and the second one waits its turn again: measured here, two sends cost ~2x the latency of one and put
that client overhead inside TTFT and throughput. aiohttp, which `vllm bench serve` uses, sends once.
So writes are held until the connection's next read: for a request/response exchange that is exactly
"headers + body, then read the response".
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpcore
import httpx


class _OneWriteStream(httpcore.AsyncNetworkStream):
    """A connection whose writes are buffered until the next read (or TLS start / close)."""

    def __init__(self, stream: httpcore.AsyncNetworkStream):
        self._stream = stream
        self._pending: list[bytes] = []

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._pending.append(buffer)

    async def _flush(self, timeout: float | None) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            await self._stream.write(data, timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        await self._flush(timeout)
        return await self._stream.read(max_bytes, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        await self._flush(timeout)
        return _OneWriteStream(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _OneWriteBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        return _OneWriteStream(await self._backend.connect_tcp(host, port, timeout, local_address, socket_options))

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        return _OneWriteStream(await self._backend.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class _ResponseBody(httpx.AsyncByteStream):
    def __init__(self, stream: Any):
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._stream:
            yield part

    async def aclose(self) -> None:
        await self._stream.aclose()


class OneWriteTransport(httpx.AsyncBaseTransport):
    """httpcore's connection pool over the one-write backend (timeouts come from the request, as usual)."""

    def __init__(self, limits: httpx.Limits):
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry, network_backend=_OneWriteBackend())

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
