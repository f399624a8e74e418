"""The project's one load generator, for OpenAI-compatible `/v1/completions` and `/v1/chat/completions`.

`hpcserve bench` runs on it, and so does every benchmark that sends load (benchmarks/scale_load.py,
benchmarks/gpu/prefix_client.py, benchmarks/router.py). A run is a list of RequestInputs and their
arrival offsets: zeros with a concurrency make a closed loop, increasing offsets an open loop (a rate),
both together an open loop capped in flight. A request is streamed (SSE) or not, with a text prompt,
token ids or chat messages, and headers of its own (a session key for a router, a request id).

Modelled on vLLM's benchmark request functions so numbers are comparable with `vllm bench serve`:
- TTFT runs from just before the request is sent to the first SSE chunk that carries `choices`
  (its text may be empty, e.g. a special token) -- vLLM's definition.
- E2E latency ends at the last chunk that carries `choices`, not at `[DONE]` -- also vLLM's.
- ITL is the gap between consecutive `choices` chunks; output tokens come from the usage in the final
  chunk (`stream_options.include_usage`), or, when a server sends none, from counting chunks.
- A non-streamed request has TTFT = E2E = the whole answer's time; its tokens come from the usage.
A failed request becomes a RequestOutput with ok=False and the error text; nothing here raises
for a bad response. The whole run has one deadline on the monotonic clock, and optionally a send
window after which nothing new is sent (a load "for D seconds").

HTTP is aiohttp, the stack `vllm bench serve` itself uses: one pooled session per run, its connector
limited to the run's concurrency and keeping connections alive between requests. On a machine shared
with the server, client CPU is server CPU lost, so a client as light as vLLM's keeps the figures comparable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from hpcserve.core.keys import bearer
from hpcserve.engine.client import Endpoint

CONNECT_TIMEOUT_S = 10.0
ERROR_BODY_CHARS = 300


Messages = list[dict]  # a chat conversation: [{"role": ..., "content": ...}, ...]


@dataclass(frozen=True)
class RequestInput:
    """One request: a prompt (text, token ids sent as-is, or chat messages) and the exact number of
    tokens to generate. Chat messages go to /v1/chat/completions, every other prompt to /v1/completions."""

    prompt: list[int] | str | Messages
    output_len: int
    prompt_len: int | None = None  # known up front for token-id prompts; else read from the usage
    stream: bool = True
    headers: Mapping[str, str] | None = None  # e.g. x-session-id for a router's session affinity
    temperature: float | None = None  # None: the server's default

    @property
    def is_chat(self) -> bool:
        return bool(self.prompt) and isinstance(self.prompt, list) and isinstance(self.prompt[0], dict)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.is_chat else "/v1/completions"


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
    text: str = ""  # the generated text (a multi-turn client sends it back as history)
    cached_tokens: int | None = None  # prompt tokens from the prefix cache, where the server says (vLLM:
    #                                   --enable-prompt-tokens-details)


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
    """outputs[i] is inputs[i]'s; with a send window, only the requests sent are there (sent[i] is the
    index of outputs[i] in the inputs), otherwise every input has its output and sent is range(n)."""

    outputs: list[RequestOutput]
    duration_s: float
    started_at: float  # epoch seconds: lines the run up with server logs and other clients' records
    sent: list[int] = field(default_factory=list)


class Repeated(Sequence):
    """One value `count` times, without a list of them: the inputs and offsets of a closed loop that runs
    until its send window ends."""

    def __init__(self, value, count: int):
        self.value, self.times = value, count  # not self.count: Sequence.count is a method

    def __len__(self) -> int:
        return self.times

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.value] * len(range(*index.indices(self.times)))
        if not -self.times <= index < self.times:
            raise IndexError(index)
        return self.value


def completion_body(model: str, request: RequestInput, ignore_eos: bool) -> dict:
    """max_tokens with ignore_eos makes the output length exact; usage (in a stream's last chunk) counts it."""
    body: dict = {
        "model": model,
        "messages" if request.is_chat else "prompt": request.prompt,
        "max_tokens": request.output_len,
        "ignore_eos": ignore_eos,
        "stream": request.stream,
    }
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    if request.temperature is not None:
        body["temperature"] = request.temperature
    return body


def choice_text(choice: dict) -> str:
    """A completion choice's text, or a chat choice's (streamed delta or whole message) content. Pure."""
    if "text" in choice:
        return choice.get("text") or ""
    return ((choice.get("delta") or choice.get("message") or {}).get("content")) or ""


def cached_tokens(usage: dict) -> int | None:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")



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
    pieces: list[str] = field(default_factory=list)

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
            self.pieces.extend(choice_text(choice) for choice in data["choices"])
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
            text="".join(self.pieces), cached_tokens=cached_tokens(usage),
        )

    def failure(self, error: str, run_start: float) -> RequestOutput:
        return RequestOutput(ok=False, error=error, start_s=self.sent_at - run_start)


async def send_request(session: aiohttp.ClientSession, endpoint: Endpoint, request: RequestInput,
                       ignore_eos: bool, run_start: float) -> RequestOutput:
    """Send one completion (streamed or not) and time it. Never raises for a failed request."""
    timer = _StreamTimer(sent_at=time.perf_counter())
    body = completion_body(endpoint.model or "", request, ignore_eos)
    headers = {**bearer(endpoint.api_key), **(request.headers or {})}
    try:
        async with session.post(f"{endpoint.base_url}{request.path}", json=body, headers=headers) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")[:ERROR_BODY_CHARS]
                return timer.failure(f"HTTP {response.status}: {text}", run_start)
            if not request.stream:
                return whole_answer(await response.json(content_type=None), request, timer, run_start)
            async for line in response.content:  # one SSE line at a time, as bytes arrive
                data = parse_sse_line(line)
                if data is not None:
                    timer.on_chunk(data, time.perf_counter())
    except Exception as exc:  # noqa: BLE001 -- any failure is data about the server, recorded not raised
        return timer.failure(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, run_start)
    return timer.output(request, run_start)


def whole_answer(data: dict, request: RequestInput, timer: _StreamTimer, run_start: float) -> RequestOutput:
    """A non-streamed answer: its first token and its last came together, when the body had arrived."""
    done = time.perf_counter()
    if data.get("error") or not data.get("choices"):
        return timer.failure(f"no choices in the answer: {str(data)[:ERROR_BODY_CHARS]}", run_start)
    usage = data.get("usage") or {}
    return RequestOutput(ok=True, ttft_s=done - timer.sent_at, e2e_s=done - timer.sent_at,
                         prompt_tokens=usage.get("prompt_tokens", request.prompt_len),
                         output_tokens=usage.get("completion_tokens") or 1, start_s=timer.sent_at - run_start,
                         text="".join(choice_text(c) for c in data["choices"]), cached_tokens=cached_tokens(usage))


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
                   on_done: Callable[[RequestOutput], None] | None = None,
                   send_window_s: float | None = None, request_timeout_s: float | None = None) -> LoadResult:
    """Send inputs[i] at offsets[i] seconds (non-decreasing) to endpoints[i % n], at most shape.concurrency
    in flight, in the order of the inputs; stop at the deadline (timeout_s after the start).

    Endpoints must carry the model name. Without a send window, requests still waiting or in flight at
    the deadline are recorded as failed, so len(outputs) == len(inputs). With send_window_s, nothing is
    sent after that many seconds, requests not sent by then are left out (LoadResult.sent says which
    were sent), and the ones in flight may finish until the deadline. request_timeout_s (default
    timeout_s) bounds waiting for a connection and a stalled response (make_session).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s  # loop.time() is the monotonic clock
    slots = asyncio.Semaphore(shape.concurrency) if shape.concurrency else None
    outputs: dict[int, RequestOutput] = {}
    async with make_session(shape, request_timeout_s or timeout_s) as session:
        run_start, started_at = time.perf_counter(), time.time()
        window_end = run_start + send_window_s if send_window_s is not None else math.inf
        in_flight: set[asyncio.Task] = set()

        async def one(index: int) -> None:
            try:
                async with asyncio.timeout_at(deadline):
                    output = await send_request(session, endpoints[index % len(endpoints)], inputs[index],
                                                ignore_eos, run_start)
            except TimeoutError:
                output = _past_deadline(run_start)
            finally:
                if slots:
                    slots.release()
            outputs[index] = output
            if on_done:
                on_done(output)

        # One dispatcher, not a task per input: a closed loop may offer millions of inputs.
        dispatched = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                while dispatched < len(inputs):
                    send_at = run_start + offsets[dispatched]
                    if send_at > window_end:
                        break
                    await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
                    if slots:
                        await slots.acquire()
                    if time.perf_counter() > window_end:
                        if slots:
                            slots.release()
                        break
                    task = asyncio.create_task(one(dispatched))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                    dispatched += 1
        if in_flight:
            await asyncio.wait(set(in_flight))
        duration_s = time.perf_counter() - run_start
    if send_window_s is None:
        for index in range(dispatched, len(inputs)):  # never sent: the deadline came first
            outputs[index] = _past_deadline(run_start)
            if on_done:
                on_done(outputs[index])
    sent = sorted(outputs)
    return LoadResult(outputs=[outputs[i] for i in sent], duration_s=duration_s, started_at=started_at, sent=sent)


def _past_deadline(run_start: float) -> RequestOutput:
    return RequestOutput(ok=False, error="run deadline reached (see --timeout)", start_s=time.perf_counter() - run_start)
