"""An async load generator for OpenAI-compatible `/v1/completions` endpoints (streaming SSE).

Modelled on vLLM's benchmark request functions so numbers are comparable with `vllm bench serve`:
- TTFT runs from just before the request is sent to the first SSE chunk that carries `choices`
  (its text may be empty, e.g. a special token) -- vLLM's definition.
- E2E latency ends at the last chunk that carries `choices`, not at `[DONE]` -- also vLLM's.
- ITL is the gap between consecutive `choices` chunks; output tokens come from the usage in the final
  chunk (`stream_options.include_usage`), or, when a server sends none, from counting chunks.
A failed request becomes a RequestOutput with ok=False and the error text; nothing here raises
for a bad response. The whole run has one deadline on the monotonic clock.

HTTP is aiohttp, the stack `vllm bench serve` itself uses: one pooled session per run, its connector
limited to the run's concurrency and keeping connections alive between requests. On a machine shared
with the server, client CPU is server CPU lost, so a client as light as vLLM's keeps the figures comparable.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from hpcserve.core.keys import bearer
from hpcserve.engine.client import Endpoint

CONNECT_TIMEOUT_S = 10.0
ERROR_BODY_CHARS = 300


@dataclass(frozen=True)
class RequestInput:
    """One request: a prompt (text, or token ids sent as-is) and the exact number of tokens to generate."""

    prompt: list[int] | str
    output_len: int
    prompt_len: int | None = None  # known up front for token-id prompts; else read from the usage


@dataclass(frozen=True)
class RequestOutput:
    """What happened to one request. Times in seconds; start_s is from the start of the run."""

    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    start_s: float = 0.0


@dataclass(frozen=True)
class LoadShape:
    """How requests arrive: at most `concurrency` in flight (None: unbounded), at `request_rate` per second."""

    concurrency: int | None = None
    request_rate: float = math.inf

    @property
    def label(self) -> str:
        parts = []
        if self.concurrency is not None:
            parts.append(f"concurrency={self.concurrency}")
        if not math.isinf(self.request_rate) or not parts:
            parts.append(f"rate={self.request_rate:g}")
        return ",".join(parts)

    @property
    def short_label(self) -> str:
        """For a column header: c=8, 2.5 r/s, or both."""
        parts = [f"c={self.concurrency}"] if self.concurrency is not None else []
        if not math.isinf(self.request_rate) or not parts:
            parts.append(f"{self.request_rate:g} r/s")
        return " ".join(parts)

    def as_dict(self) -> dict:
        """JSON-safe: an infinite rate is written "inf" (strict JSON has no Infinity)."""
        rate = "inf" if math.isinf(self.request_rate) else self.request_rate
        return {"concurrency": self.concurrency, "request_rate": rate}

    @classmethod
    def from_dict(cls, data: dict) -> LoadShape:
        return cls(data.get("concurrency"), float(data.get("request_rate", "inf")))


@dataclass(frozen=True)
class LoadResult:
    outputs: list[RequestOutput]
    duration_s: float
    started_at: float  # epoch seconds: lines the run up with server logs and other clients' records


def completion_body(model: str, request: RequestInput, ignore_eos: bool) -> dict:
    """max_tokens with ignore_eos makes the output length exact; usage in the last chunk counts it."""
    return {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }




def parse_sse_line(line: bytes) -> dict | None:
    """The JSON payload of one `data:` line; None for blank lines, comments (pings) and [DONE]."""
    if not line.startswith(b"data:"):
        return None
    payload = line[len(b"data:"):].strip()
    if not payload or payload == b"[DONE]":
        return None
    return json.loads(payload)


@dataclass
class _StreamTimer:
    """Mutable while the stream is read; frozen into a RequestOutput at the end."""

    sent_at: float
    first_at: float | None = None
    last_at: float | None = None
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0
    usage: dict | None = None

    def on_chunk(self, data: dict, now: float) -> None:
        if data.get("error"):
            raise RuntimeError(f"server error in stream: {data['error']}")
        if data.get("choices"):
            if self.last_at is None:  # the first token
                self.first_at = now
            else:
                self.gaps.append(now - self.last_at)
            self.last_at = now
            self.chunks += 1
        if data.get("usage"):
            self.usage = data["usage"]

    def output(self, request: RequestInput, run_start: float) -> RequestOutput:
        usage = self.usage or {}
        if self.first_at is None or self.last_at is None:
            return self.failure("the stream ended before any token arrived", run_start)
        return RequestOutput(
            ok=True, ttft_s=self.first_at - self.sent_at, itl_s=self.gaps, e2e_s=self.last_at - self.sent_at,
            prompt_tokens=usage.get("prompt_tokens", request.prompt_len),
            output_tokens=usage.get("completion_tokens") or self.chunks, start_s=self.sent_at - run_start,
        )

    def failure(self, error: str, run_start: float) -> RequestOutput:
        return RequestOutput(ok=False, error=error, start_s=self.sent_at - run_start)


async def send_request(session: aiohttp.ClientSession, endpoint: Endpoint, request: RequestInput,
                       ignore_eos: bool, run_start: float) -> RequestOutput:
    """Send one streaming completion and time it. Never raises for a failed request."""
    timer = _StreamTimer(sent_at=time.perf_counter())
    body = completion_body(endpoint.model or "", request, ignore_eos)
    try:
        async with session.post(f"{endpoint.base_url}/v1/completions", json=body,
                                headers=bearer(endpoint.api_key)) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")[:ERROR_BODY_CHARS]
                return timer.failure(f"HTTP {response.status}: {text}", run_start)
            async for line in response.content:  # one SSE line at a time, as bytes arrive
                data = parse_sse_line(line)
                if data is not None:
                    timer.on_chunk(data, time.perf_counter())
    except Exception as exc:  # noqa: BLE001 -- any failure is data about the server, recorded not raised
        return timer.failure(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, run_start)
    return timer.output(request, run_start)


def make_session(shape: LoadShape, timeout_s: float) -> aiohttp.ClientSession:
    """One pooled session per run, at most `concurrency` connections (None: no limit), kept alive.

    Timeouts: CONNECT_TIMEOUT_S to open a connection; timeout_s to get a free one from the pool, and
    between two reads of a response (a stalled stream); no total (the run's deadline bounds everything).
    No proxies from the environment (trust_env=False): a site proxy would sit inside every latency.
    """
    connector = aiohttp.TCPConnector(limit=shape.concurrency or 0, limit_per_host=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_connect=CONNECT_TIMEOUT_S,
                                    sock_read=timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False,
                                 headers={"Accept-Encoding": "identity"})  # raw SSE bytes, parsed as they come


async def run_load(endpoints: Sequence[Endpoint], inputs: Sequence[RequestInput], shape: LoadShape,
                   offsets: Sequence[float], *, timeout_s: float, ignore_eos: bool = True,
                   on_done: Callable[[RequestOutput], None] | None = None) -> LoadResult:
    """Send inputs[i] at offsets[i] seconds to endpoints[i % n] (round-robin); stop at the deadline.

    Endpoints must carry the model name. Requests still waiting or in flight at the deadline are
    recorded as failed, so len(outputs) == len(inputs) always.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s  # loop.time() is the monotonic clock
    slots = asyncio.Semaphore(shape.concurrency) if shape.concurrency else None
    async with make_session(shape, timeout_s) as session:
        run_start, started_at = time.perf_counter(), time.time()

        async def one(index: int) -> RequestOutput:
            output = await _send_on_time(session, endpoints[index % len(endpoints)], inputs[index],
                                         run_start + offsets[index], slots, deadline, ignore_eos, run_start)
            if on_done:
                on_done(output)
            return output

        outputs = await asyncio.gather(*(one(i) for i in range(len(inputs))))
        return LoadResult(outputs=list(outputs), duration_s=time.perf_counter() - run_start, started_at=started_at)


async def _send_on_time(session: aiohttp.ClientSession, endpoint: Endpoint, request: RequestInput, send_at: float,
                        slots: asyncio.Semaphore | None, deadline: float, ignore_eos: bool,
                        run_start: float) -> RequestOutput:
    """Wait for the arrival time and a free slot, then send; give up at the run deadline."""
    try:
        async with asyncio.timeout_at(deadline):
            await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
            if slots is None:
                return await send_request(session, endpoint, request, ignore_eos, run_start)
            async with slots:
                return await send_request(session, endpoint, request, ignore_eos, run_start)
    except TimeoutError:
        return RequestOutput(ok=False, error="run deadline reached (see --timeout)",
                             start_s=time.perf_counter() - run_start)
