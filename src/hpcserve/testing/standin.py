"""Fast OpenAI-compatible stand-ins for vLLM engines: fixed completions (plain and SSE), /health,
/v1/models, and vLLM's /metrics. They exist so that the router's and the controller's own costs can be
measured where an engine's noise would hide them, and so that drain/retry/failure behaviour can be
checked at exact moments.

    python -m hpcserve.testing.standin --port P [--name N] [--token-delay-ms D] [--tokens K] [--slots S]
    python -m hpcserve.testing.standin --count N --admin-port A [...]    # a farm: N stand-ins, one process

Each response names the stand-in that answered (`system_fingerprint`, header `x-backend`), and each
counts what it served (GET /stub/stats), so tests can see where requests went. With --slots S it runs
at most S requests at once and queues the rest, as an engine with `--max-num-seqs S` does: two stand-ins
with different slots stand for replicas of different capacity. A request's service time is
tokens x token delay. /metrics is a real vLLM /metrics page (50 KB, histograms and all: what a
controller reads from a real engine), with running, waiting, KV-cache usage and finished requests
filled in; --small-metrics serves only those four families.
 The prompts __answer_400__ and __answer_500__ get a client error and an engine error; __crash__ is
counted and its connection cut without an answer (a request that kills its engine). A body that is no
JSON object in UTF-8 gets 400 in OpenAI's error shape, as vLLM 0.32 answers invalid JSON (a body that is not
UTF-8 gets FastAPI's 400 {"detail": ...} from vLLM instead). --first-token-delay-ms
holds a stream's first chunk back (headers go at once, as vLLM's do) and a whole answer as long. A client
that disconnects cancels its request at once, as vLLM aborts one whose connection closed.
When HPCSERVE_STUB_API_KEY is set, requests without `Authorization: Bearer <key>` get 401, as vLLM does
(the scheme in any case, as vLLM reads it).

With --kv-tokens K a stand-in has vLLM's prefix cache, so that cache hits follow a router's choices as
an engine's would: tokens are the prompt's whitespace-separated words (benchmarks/gpu/model_folder.py's
tokenizer: one word, one token; a chat prompt is its messages' contents each followed by a space), the
cache holds K / 16 whole 16-token blocks named by a hash chained over everything before them, least
recently used dropped first, and never the prompt's last token. A request waits --prefill-us per
uncached prompt token before its first token; answers are words `wN`; usage counts the words and says
the cached tokens (prompt_tokens_details); /metrics adds vLLM's prefix-cache and token counters.
Every stand-in also answers /tokenize and the two /render routes (vllm-router's cache_aware asks them
for token ids: a word `wN` is id N) and, with VLLM_SERVER_DEV_MODE=1 as vLLM wants, POST
/reset_prefix_cache. A path it does not serve is logged. benchmarks/gpu/vllm_standin.py starts one with
`vllm serve`'s arguments.

A farm (--count N) serves N stand-ins on N ports from one process (one event loop), and an admin API
on --admin-port that the benchmarks drive:

    GET  /farm                      {"pid", "standins": [{"port", "name", "state", "requests", ...}]}
    POST /farm/kill?port=P&port=Q   as kill -9: the port stops listening and open connections are cut
    POST /farm/stop?port=P          graceful: no new connections, in-flight requests finish
    POST /farm/freeze?port=P        as a hung engine: connections are accepted, nothing is ever answered
    POST /farm/start?port=P         serve again on the same port (a replacement)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from importlib import resources

from aiohttp import web

from hpcserve.core.keys import KeyCheck

STATS = web.AppKey("stats", dict)
SLOTS = web.AppKey("slots", asyncio.Semaphore)
BAD_PROMPT = "__answer_400__"
FAILING_PROMPT = "__answer_500__"
CRASHING_PROMPT = "__crash__"
CONFIG = web.AppKey("config", dict)
FROZEN = web.AppKey("frozen", asyncio.Event)
BLOCK_TOKENS = 16  # vLLM's default KV block
FILLED_FAMILIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:request_success_total", "vllm:request_success_created")


def completion_body(name: str, chat: bool, text: str, tokens: int) -> dict:
    """A whole (non-streamed) OpenAI completion. Pure."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
              if chat else {"index": 0, "text": text, "finish_reason": "length"})
    return {"id": "cmpl-stub", "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": "stub", "system_fingerprint": name, "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}}


def compact(data) -> str:
    """JSON as vLLM writes its answers (pydantic's model_dump_json, starlette's JSONResponse): no spaces. The data
    plane reads some fields as bytes (sse.strip_ids, migration.Record.token_counts), as they come from vLLM."""
    return json.dumps(data, separators=(",", ":"))


def chunk_line(name: str, chat: bool, text: str, ids: dict | None = None) -> bytes:
    """One SSE `data:` event carrying one token; ids: a completion's token ids as vLLM sends them with
    return_token_ids ({"prompt_token_ids": [...] or None, "token_ids": [...]}). Pure."""
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text, **(ids or {})}
    body = {"id": "cmpl-stub", "object": "chat.completion.chunk" if chat else "text_completion",
            "model": "stub", "system_fingerprint": name, "choices": [choice]}
    return b"data: " + compact(body).encode() + b"\n\n"


# ------------------------------------------------------------------ /metrics

@dataclass(frozen=True)
class MetricsPage:
    """vLLM's /metrics with the four figures a controller reads left as holes: the rest of the page is
    a real engine's (tests/monitoring/data), so reading and parsing it costs what a real one costs."""

    before: str  # everything of the real page except the filled families
    small: bool = False

    @classmethod
    def load(cls, small: bool = False) -> MetricsPage:
        text = "" if small else resources.files("hpcserve.testing").joinpath("vllm_metrics.txt").read_text()
        return cls(without_families(text, FILLED_FAMILIES), small)

    def render(self, running: float, waiting: float, kv_usage: float, finished: float) -> str:
        return self.before + filled_families(running, waiting, kv_usage, finished)


def without_families(text: str, names: tuple[str, ...]) -> str:
    """Prometheus text without the HELP/TYPE/sample lines of the named families. Pure."""
    alternatives = "|".join(re.escape(n) for n in names)
    pattern = re.compile(rf"^(# (HELP|TYPE) )?({alternatives})[ {{]")
    return "".join(line for line in text.splitlines(keepends=True) if not pattern.match(line))


def filled_families(running: float, waiting: float, kv_usage: float, finished: float) -> str:
    """The four families in vLLM's own spelling (labels included). Pure."""
    labels = 'engine="0",model_name="stub"'
    return ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {float(kv_usage)}\n"
            "# HELP vllm:request_success_total Count of successfully processed requests.\n"
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{{labels},finished_reason="length"}} {float(finished)}\n')


# ------------------------------------------------------------------ the prefix cache (--kv-tokens)

class PrefixCache:
    """vLLM's prefix cache in miniature: whole blocks of words, each named by a hash chained over everything
    before it, the least recently used dropped first."""

    def __init__(self, tokens: int):
        self.capacity = max(1, tokens // BLOCK_TOKENS)
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.counters = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "prompt_tokens": 0,
                         "generation_tokens": 0, "num_preemptions": 0,
                         "time_to_first_token_seconds_sum": 0.0, "time_to_first_token_seconds_count": 0}

    @staticmethod
    def hashes(tokens: list[str]) -> list[bytes]:
        out, previous = [], b""
        for start in range(0, len(tokens) - len(tokens) % BLOCK_TOKENS, BLOCK_TOKENS):
            previous = hashlib.blake2b(previous + " ".join(tokens[start:start + BLOCK_TOKENS]).encode(),
                                       digest_size=8).digest()
            out.append(previous)
        return out

    def lookup(self, tokens: list[str]) -> int:
        """Tokens served from the cache: leading whole blocks, never the whole prompt (as vLLM)."""
        hit = 0
        for block in self.hashes(tokens[:-1]):
            if block not in self.blocks:
                break
            self.blocks.move_to_end(block)
            hit += 1
        self.counters["prefix_cache_queries"] += len(tokens)
        self.counters["prefix_cache_hits"] += hit * BLOCK_TOKENS
        self.counters["prompt_tokens"] += len(tokens)
        return hit * BLOCK_TOKENS

    def insert(self, tokens: list[str]) -> None:
        for block in self.hashes(tokens):
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def metrics(self, model: str) -> str:
        """The counters in vLLM's names (what benchmarks/gpu/device_util.py reads)."""
        labels = f'engine="0",model_name="{model}"'
        return "".join(f"vllm:{name if name.startswith('time_to_first') else name + '_total'}{{{labels}}} "
                       f"{float(value)}\n" for name, value in self.counters.items())


def prompt_words(body: dict) -> list[str]:
    """A request's tokens for the prefix cache: a completion's prompt words, or a chat's messages'
    contents each followed by a space (the template benchmarks/gpu/routing_device.sh gives vLLM). Pure."""
    if "messages" in body:
        return "".join(str(m.get("content") or "") + " " for m in body.get("messages") or []).split()
    prompt = body.get("prompt") or ""
    return str(prompt[0] if isinstance(prompt, list) and prompt else prompt).split()


def word_ids(words: list[str]) -> list[int]:
    """model_folder.py's tokenizer: `wN` is id N, anything else <unk> (2). Pure."""
    return [int(word[1:]) if word[1:].isdigit() else 2 for word in words]


# ------------------------------------------------------------------ one stand-in

METRICS = web.AppKey("metrics", MetricsPage)
CACHE = web.AppKey("prefix_cache", PrefixCache)


def _authorized(request: web.Request) -> bool:
    """As vLLM checks its key: the Bearer scheme in any case, the token compared as a hash."""
    return request.app[CONFIG]["key_check"].allows(request.headers.get("Authorization"))


async def _frozen_gate(request: web.Request) -> None:
    """A frozen stand-in (a hung engine) accepts connections and never answers."""
    if request.app[FROZEN].is_set():
        await asyncio.Event().wait()


async def _complete(request: web.Request) -> web.StreamResponse:
    await _frozen_gate(request)
    stats = request.app[STATS]
    if not _authorized(request):
        return web.json_response({"error": "Unauthorized"}, status=401)
    if request.app[CONFIG]["asleep"]:  # a sleeping engine serves nothing until woken
        stats["refused_asleep"] += 1
        return web.json_response({"error": {"message": "the engine is sleeping", "type": "ServiceUnavailable",
                                            "code": 503}}, status=503)
    body = parsed_body(await request.read())
    if body is None:  # as vLLM answers a body it cannot read as a JSON object (its validation error: 400)
        return web.json_response(UNREADABLE_BODY, status=400)
    chat = request.path.endswith("/chat/completions")
    stats["last_body"] = body  # what the router forwarded (it re-serialises typed requests)
    if body.get("prompt") == BAD_PROMPT:  # a client error, as vLLM answers a bad request
        return web.json_response({"error": {"message": "bad request", "code": 400}}, status=400)
    if body.get("prompt") == FAILING_PROMPT:  # an engine error, as vLLM answers when generation fails
        stats["failed"] += 1
        return web.json_response({"error": {"message": "engine error", "code": 500}}, status=500)
    if body.get("prompt") == CRASHING_PROMPT:  # received, then the connection is gone: no answer at all
        stats["crashed"] += 1
        if request.transport is not None:  # None: the client has gone already
            request.transport.abort()
        await asyncio.Event().wait()
    stats["requests"] += 1
    stats["waiting"] += 1
    try:  # a client that leaves while its request waits for a slot is no longer waiting either
        await request.app[SLOTS].acquire()
    finally:
        stats["waiting"] -= 1
    try:
        return await _answer(request, body, chat)
    finally:
        request.app[SLOTS].release()


UNREADABLE_BODY = {"error": {"message": "1 validation error: the body is not a JSON object in UTF-8",
                             "type": "Bad Request", "param": "body", "code": 400}}


def parsed_body(raw: bytes) -> dict | None:
    """The request's JSON object; None for a body that is not UTF-8, not JSON, or no object. Pure.
    (aiohttp's request.json() raised on such bodies: the stand-in answered 500, which no engine does.)"""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


@dataclass
class Answer:
    """What one request gets: its tokens' texts, usage, and how long before the first token."""

    pieces: list[str]
    usage: dict
    first_delay_s: float
    prompt: list[str] = field(default_factory=list)  # the prompt's words, with a prefix cache


def plan_answer(app: web.Application, body: dict, tokens: int) -> Answer:
    config, cache = app[CONFIG], app.get(CACHE)
    if cache is None:
        return Answer(["x"] * tokens, {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1},
                      config["first_token_delay_s"])
    prompt = prompt_words(body)
    hit = cache.lookup(prompt)
    words = [f"w{config['rng'].randrange(3, 10000)}" for _ in range(tokens)]
    usage = {"prompt_tokens": len(prompt), "completion_tokens": tokens, "total_tokens": len(prompt) + tokens,
             "prompt_tokens_details": {"cached_tokens": hit}}
    delay = config["first_token_delay_s"] + (len(prompt) - hit) * config["prefill_s_per_token"]
    return Answer([(" " if i else "") + w for i, w in enumerate(words)], usage, delay, prompt)


def finished(app: web.Application, answer: Answer, started: float, first_at: float) -> None:
    cache = app.get(CACHE)
    if cache is not None:
        cache.insert(answer.prompt + [p.strip() for p in answer.pieces[:-1]])  # the last token's KV is never made
        cache.counters["generation_tokens"] += len(answer.pieces)
        cache.counters["time_to_first_token_seconds_sum"] += first_at - started
        cache.counters["time_to_first_token_seconds_count"] += 1


async def _answer(request: web.Request, body: dict, chat: bool) -> web.StreamResponse:
    config, stats = request.app[CONFIG], request.app[STATS]
    tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or config["tokens"])
    name, delay = config["name"], config["token_delay_s"]
    started = time.perf_counter()
    answer = plan_answer(request.app, body, tokens)
    stats["in_flight"] += 1
    try:
        if not body.get("stream"):
            if delay or answer.first_delay_s:
                await asyncio.sleep(answer.first_delay_s + delay * tokens)
            finished(request.app, answer, started, time.perf_counter())
            whole = completion_body(name, chat, "".join(answer.pieces), tokens)
            whole.update(model=config["model"], usage=answer.usage)
            return web.json_response(whole, headers={"x-backend": name}, dumps=compact)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-backend": name})
        await response.prepare(request)
        if answer.first_delay_s:
            await asyncio.sleep(answer.first_delay_s)
        prompt_ids = prompt_token_ids(body) if body.get("return_token_ids") and not chat else None
        first_at = None
        for number, piece in enumerate(answer.pieces):
            if delay:
                await asyncio.sleep(delay)
            first_at = first_at or time.perf_counter()
            ids = None if prompt_ids is None else {"prompt_token_ids": None if number else prompt_ids,
                                                   "token_ids": [TOKEN_ID]}
            await response.write(chunk_line(name, chat, piece, ids))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "cmpl-stub", "model": config["model"], "choices": [], "usage": answer.usage}
            await response.write(b"data: " + compact(usage).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        if config["end_delay_s"]:  # vLLM's server under load: the body's end comes a little after [DONE]
            await asyncio.sleep(config["end_delay_s"])
        await response.write_eof()
        finished(request.app, answer, started, first_at or time.perf_counter())
        return response
    finally:
        stats["in_flight"] -= 1
        stats["done"] += 1


TOKEN_ID = 120  # "x", the one token a stand-in generates


def prompt_token_ids(body: dict) -> list[int]:
    """A completion's prompt as token ids: as given (a continuation after a migration sends ids), else
    the prompt's UTF-8 bytes (a stand-in's tokenizer). Pure."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return list(str(prompt or "").encode())


async def _models(request: web.Request) -> web.Response:
    await _frozen_gate(request)
    if not _authorized(request):
        return web.json_response({"error": "Unauthorized"}, status=401)
    return web.json_response({"object": "list", "data": [{"id": request.app[CONFIG]["model"], "object": "model",
                                                          "max_model_len": 2048, "owned_by": "hpcserve"}]})


async def _metrics(request: web.Request) -> web.Response:
    await _frozen_gate(request)
    stats = request.app[STATS]
    stats["metrics_reads"] += 1
    slots = request.app[CONFIG]["slots"]
    kv = min(1.0, stats["in_flight"] / slots) if slots < 1_000_000 else 0.0
    cache = request.app.get(CACHE)
    if cache is not None:
        kv = len(cache.blocks) / cache.capacity
    text = request.app[METRICS].render(stats["in_flight"], stats["waiting"], kv, stats["done"])
    if cache is not None:
        text += cache.metrics(request.app[CONFIG]["model"])
    return web.Response(text=text, content_type="text/plain")


async def _token_ids(request: web.Request) -> web.Response:
    """/tokenize, /v1/completions/render and /v1/chat/completions/render in vLLM's shapes."""
    body = parsed_body(await request.read()) or {}
    ids = word_ids(prompt_words(body))
    if request.path == "/tokenize":
        return web.json_response({"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None})
    item = {"request_id": "render", "token_ids": ids or [2]}
    return web.json_response([item] if request.path == "/v1/completions/render" else item)


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    if os.environ.get("VLLM_SERVER_DEV_MODE") != "1":  # vLLM serves it in dev mode only
        return web.json_response({"detail": "Not Found"}, status=404)
    cache = request.app.get(CACHE)
    if cache is not None:
        cache.blocks.clear()
    return web.Response(text="")


async def _health(request: web.Request) -> web.Response:
    await _frozen_gate(request)
    request.app[STATS]["health_reads"] += 1
    return web.Response(text="")


async def _sleep(request: web.Request) -> web.Response:
    """vLLM's POST /sleep?level=N (sleep mode, VLLM_SERVER_DEV_MODE=1), behind the key as engine.guard puts it."""
    if not _authorized(request):
        return web.json_response({"error": "Unauthorized"}, status=401)
    request.app[CONFIG]["asleep"] = True
    request.app[STATS]["sleeps"] += 1
    return web.json_response({"status": "sleeping", "level": int(request.query.get("level", "1"))})


async def _wake_up(request: web.Request) -> web.Response:
    if not _authorized(request):
        return web.json_response({"error": "Unauthorized"}, status=401)
    request.app[CONFIG]["asleep"] = False
    request.app[STATS]["wakes"] += 1
    return web.json_response({"status": "awake", "tags": None})


async def _is_sleeping(request: web.Request) -> web.Response:
    if not _authorized(request):
        return web.json_response({"error": "Unauthorized"}, status=401)
    return web.json_response({"is_sleeping": request.app[CONFIG]["asleep"]})


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATS])


async def _name_every_response(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.setdefault("x-backend", request.app[CONFIG]["name"])  # 404s and /v1/models too


@web.middleware
async def _log_unserved(request: web.Request, handler):
    """A path no stand-in serves is worth a line: a router or client asking what an engine would answer."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        print(f"standin {request.app[CONFIG]['name']}: {request.method} {request.path}: not served (404)", flush=True)
        raise


def make_app(name: str, token_delay_s: float = 0.0, tokens: int = 16, api_key: str | None = None,
             slots: int = 1_000_000, metrics: MetricsPage | None = None,
             first_token_delay_s: float = 0.0, end_delay_s: float = 0.0, model: str = "stub",
             kv_tokens: int = 0, prefill_s_per_token: float = 0.0, seed: int = 0,
             sleep_mode: bool = False) -> web.Application:
    """sleep_mode: vLLM's sleep routes (POST /sleep, POST /wake_up, GET /is_sleeping), completions refused with
    503 while asleep; without it they answer 404, as vLLM on CPU or without --enable-sleep-mode does."""
    app = web.Application(middlewares=[_log_unserved])
    app[SLOTS] = asyncio.Semaphore(slots)
    app[FROZEN] = asyncio.Event()
    # With a prefix cache, vLLM's own counters go after the page: the small one leaves no duplicates.
    app[METRICS] = metrics or MetricsPage.load(small=bool(kv_tokens))
    app[CONFIG] = {"name": name, "token_delay_s": token_delay_s, "tokens": tokens, "api_key": api_key,
                   "slots": slots, "first_token_delay_s": first_token_delay_s, "end_delay_s": end_delay_s,
                   "key_check": KeyCheck(api_key), "model": model, "prefill_s_per_token": prefill_s_per_token,
                   "rng": random.Random(seed), "asleep": False}
    if kv_tokens:
        app[CACHE] = PrefixCache(kv_tokens)
    app.on_response_prepare.append(_name_every_response)
    app[STATS] = {"requests": 0, "waiting": 0, "in_flight": 0, "done": 0, "failed": 0, "crashed": 0, "last_body": None,
                  "health_reads": 0, "metrics_reads": 0, "sleeps": 0, "wakes": 0, "refused_asleep": 0}
    app.add_routes([web.post("/v1/completions", _complete), web.post("/v1/chat/completions", _complete),
                    web.get("/v1/models", _models), web.get("/health", _health), web.get("/metrics", _metrics),
                    web.get("/stub/stats", _stats), web.post("/tokenize", _token_ids),
                    web.post("/v1/completions/render", _token_ids), web.post("/v1/chat/completions/render", _token_ids),
                    web.post("/reset_prefix_cache", _reset_prefix_cache)])
    if sleep_mode:
        app.add_routes([web.post("/sleep", _sleep), web.post("/wake_up", _wake_up),
                        web.get("/is_sleeping", _is_sleeping)])
    return app


# ------------------------------------------------------------------ a farm of stand-ins

class StandinState(StrEnum):
    SERVING = "serving"
    KILLED = "killed"  # as kill -9: not listening, connections were cut
    STOPPED = "stopped"  # graceful: not listening
    FROZEN = "frozen"  # listening, never answering (a node gone silent)


@dataclass
class Standin:
    """One stand-in of a farm: its app, and the runner that serves it on its port."""

    port: int
    app: web.Application
    host: str = "127.0.0.1"
    runner: web.AppRunner | None = None
    state: StandinState = StandinState.STOPPED
    changed: float = field(default_factory=time.time)

    async def start(self) -> None:
        self.app[FROZEN].clear()
        if self.runner is None:
            self.runner = web.AppRunner(self.app, access_log=None, handle_signals=False, handler_cancellation=True)
            await self.runner.setup()
            await web.TCPSite(self.runner, self.host, self.port, reuse_address=True, backlog=1024).start()
        self._set(StandinState.SERVING)

    async def kill(self) -> None:
        """As kill -9: the listener closes and every open connection (idle keep-alive ones too) is cut."""
        runner, self.runner = self.runner, None
        if runner is not None:
            for site in list(runner.sites):
                await site.stop()
            for handler in runner.server.connections if runner.server else []:
                if handler.transport is not None:
                    handler.transport.abort()
            asyncio.get_running_loop().create_task(runner.cleanup())
        self._set(StandinState.KILLED)

    async def stop(self) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            await runner.cleanup()
        self._set(StandinState.STOPPED)

    async def freeze(self) -> None:
        self.app[FROZEN].set()
        self._set(StandinState.FROZEN)

    def _set(self, state: StandinState) -> None:
        self.state, self.changed = state, time.time()

    def describe(self) -> dict:
        stats = self.app[STATS]
        return {"port": self.port, "name": self.app[CONFIG]["name"], "state": self.state, "changed": self.changed,
                **{k: stats[k] for k in ("requests", "done", "in_flight", "waiting", "health_reads", "metrics_reads")}}


class Farm:
    """N stand-ins on N ports in one event loop, and the admin API that changes them."""

    def __init__(self, ports: list[int], host: str = "127.0.0.1", **app_settings):
        metrics = MetricsPage.load(app_settings.pop("small_metrics", False) or bool(app_settings.get("kv_tokens")))
        self.standins = {port: Standin(port, make_app(f"s{port}", metrics=metrics, **app_settings), host)
                         for port in ports}

    async def start_all(self) -> None:
        for standin in self.standins.values():
            await standin.start()

    def admin_app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.get("/farm", self._describe)] +
                       [web.post(f"/farm/{action}", self._action) for action in ("kill", "stop", "freeze", "start")])
        return app

    async def _describe(self, _request: web.Request) -> web.Response:
        return web.json_response({"pid": os.getpid(), "standins": [s.describe() for s in self.standins.values()]})

    async def _action(self, request: web.Request) -> web.Response:
        ports = [int(p) for p in request.query.getall("port", [])]
        unknown = [p for p in ports if p not in self.standins]
        if unknown:
            return web.json_response({"error": f"not a stand-in of this farm: {unknown}"}, status=404)
        action = request.path.rsplit("/", 1)[1]
        await asyncio.gather(*(getattr(self.standins[p], action)() for p in ports))
        return web.json_response({"done": action, "ports": ports})


async def serve_farm(farm: Farm, admin_port: int) -> None:
    await farm.start_all()
    runner = web.AppRunner(farm.admin_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", admin_port).start()
    print(f"farm: {len(farm.standins)} stand-ins, admin on 127.0.0.1:{admin_port}", flush=True)
    await asyncio.Event().wait()  # until SIGTERM/SIGINT


def run_loop(main_coroutine) -> None:
    """uvloop when it is there (as vLLM's API server uses it): a stand-in must not be slower than an engine."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coroutine)
        return
    uvloop.run(main_coroutine)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, help="the stand-in's port; with --count, the first of consecutive ports")
    parser.add_argument("--ports", help="a farm's ports, comma-separated (instead of --port and --count)")
    parser.add_argument("--count", type=int, default=0, help="a farm of this many stand-ins")
    parser.add_argument("--admin-port", type=int, help="the farm's admin API")
    parser.add_argument("--name", default="stub")
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--first-token-delay-ms", type=float, default=0.0)
    parser.add_argument("--end-delay-ms", type=float, default=0.0, help="a stream's end this long after its [DONE]")
    parser.add_argument("--slots", type=int, default=1_000_000, help="requests run at once; the rest wait")
    parser.add_argument("--small-metrics", action="store_true", help="/metrics with the four read families only")
    parser.add_argument("--model", default="stub", help="the model name /v1/models gives")
    parser.add_argument("--kv-tokens", type=int, default=0, help="a prefix cache of this many tokens (0: none)")
    parser.add_argument("--prefill-us", type=float, default=0.0, help="with --kv-tokens: per uncached prompt token")
    args = parser.parse_args(argv)
    settings = {"token_delay_s": args.token_delay_ms / 1000.0, "tokens": args.tokens,
                "first_token_delay_s": args.first_token_delay_ms / 1000.0, "end_delay_s": args.end_delay_ms / 1000.0,
                "api_key": os.environ.get("HPCSERVE_STUB_API_KEY"), "slots": args.slots, "model": args.model,
                "kv_tokens": args.kv_tokens, "prefill_s_per_token": args.prefill_us / 1e6}
    if args.ports or args.count:
        ports = ([int(p) for p in args.ports.split(",")] if args.ports
                 else list(range(args.port, args.port + args.count)))
        farm = Farm(ports, args.host, small_metrics=args.small_metrics, **settings)
        run_loop(serve_farm(farm, args.admin_port))
        return
    app = make_app(args.name, metrics=MetricsPage.load(args.small_metrics or bool(args.kv_tokens)), **settings)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
