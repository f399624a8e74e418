"""A CPU stand-in for `vllm serve` with a prefix cache, for dry runs of routing_device.sh (no GPU, no vLLM):

    ROUTING_VLLM="python3 benchmarks/gpu/vllm_standin.py" bash benchmarks/gpu/routing_device.sh ...
    python3 vllm_standin.py serve MODEL --port P [--kv-cache-memory-bytes B] [--enable-prompt-tokens-details]
                            [--max-num-seqs S] [...]   (other vLLM flags are accepted and ignored)

Tokens are the prompt's whitespace-separated words (model_folder.py's tokenizer: one word, one token); a chat
request's prompt is its messages' contents each followed by a space (the template routing_device.sh gives
vLLM). The prefix cache holds whole 16-token blocks named by a hash chained over everything before them,
least recently used dropped first, KV_BYTES / 131072 tokens (the Llama-3.1-8B shape's bytes a token), so
hits follow a router's choices as vLLM's would. Time: a request waits for one of S slots, then
--prefill-us per uncached prompt token and --decode-ms per output token (no sharing of a GPU: this checks
the scripts, it measures nothing). Serves /v1/completions and /v1/chat/completions (streamed or not, usage
with prompt_tokens_details.cached_tokens when asked), /v1/models, /health, POST /reset_prefix_cache
(VLLM_SERVER_DEV_MODE=1 as vLLM wants), /tokenize and the two /render routes (vllm-router's cache_aware asks
them for token ids), and /metrics with vLLM's counter names. With VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode
also sleep mode's routes (POST /sleep?level=&mode=abort|wait, /wake_up?tags=, /collective_rpc, GET /is_sleeping;
for sleep_wake.py's dry run): a sleeping engine holds new requests until it wakes, mode=abort ends the streams in
flight with finish_reason "abort", mode=wait waits for them; sleeping and waking take STANDIN_SLEEP_MS. Logs `GPU KV cache size: N
tokens` as vLLM does, and every path it does not serve.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import sys
import time
from collections import OrderedDict

from aiohttp import web

BLOCK = 16
BYTES_PER_TOKEN = 131072  # Llama-3.1-8B: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes


class PrefixCache:
    def __init__(self, blocks: int):
        self.capacity, self.blocks = blocks, OrderedDict()

    @staticmethod
    def hashes(tokens: list[str]) -> list[bytes]:
        out, prev = [], b""
        for i in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
            prev = hashlib.blake2b(prev + " ".join(tokens[i:i + BLOCK]).encode(), digest_size=8).digest()
            out.append(prev)
        return out

    def lookup(self, tokens: list[str]) -> int:
        """Tokens served from the cache (leading whole blocks; never the whole prompt, as vLLM)."""
        hit = 0
        for h in self.hashes(tokens[:-1]):
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            hit += 1
        return hit * BLOCK

    def insert(self, tokens: list[str]) -> None:
        for h in self.hashes(tokens):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def prompt_tokens(body: dict, chat: bool) -> list[str]:
    if chat:
        return "".join(str(m.get("content") or "") + " " for m in body.get("messages") or []).split()
    prompt = body.get("prompt") or ""
    return (prompt[0] if isinstance(prompt, list) else prompt).split()


class Engine:
    def __init__(self, a):
        self.a = a
        self.kv_tokens = (a.kv_cache_memory_bytes or 8 * 2**30) // BYTES_PER_TOKEN // BLOCK * BLOCK
        self.cache = PrefixCache(self.kv_tokens // BLOCK)
        self.slots = asyncio.Semaphore(a.max_num_seqs)
        self.counters = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "request_success": 0,
                         "prompt_tokens": 0, "generation_tokens": 0, "num_preemptions": 0,
                         "time_to_first_token_seconds_sum": 0.0, "time_to_first_token_seconds_count": 0}
        self.running = self.waiting = 0
        self.rng = random.Random(a.port)
        self.awake = asyncio.Event()
        self.awake.set()
        self.aborting = False
        self.asleep_tags: set[str] = set()

    async def complete(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        body = await request.json()
        tokens = prompt_tokens(body, chat)
        n_out = int(body.get("max_tokens") or 16)
        t0 = time.perf_counter()
        self.waiting += 1
        await self.awake.wait()
        async with self.slots:
            self.waiting -= 1
            self.running += 1
            try:
                return await self.serve(request, body, chat, tokens, n_out, t0)
            finally:
                self.running -= 1

    async def serve(self, request, body, chat, tokens, n_out, t0) -> web.StreamResponse:
        hit = self.cache.lookup(tokens)
        c = self.counters
        c["prefix_cache_queries"] += len(tokens)
        c["prefix_cache_hits"] += hit
        c["prompt_tokens"] += len(tokens)
        await asyncio.sleep((len(tokens) - hit) * self.a.prefill_us / 1e6)
        out = [f"w{self.rng.randrange(3, 10000)}" for _ in range(n_out)]
        c["time_to_first_token_seconds_sum"] += time.perf_counter() - t0
        c["time_to_first_token_seconds_count"] += 1
        usage = {"prompt_tokens": len(tokens), "completion_tokens": n_out, "total_tokens": len(tokens) + n_out}
        if self.a.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": hit}
        kind = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            await asyncio.sleep(n_out * self.a.decode_ms / 1e3)
            self.finish(tokens, out)
            text = " ".join(out)
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": " " + text}
            choice["finish_reason"] = "length"
            return web.json_response({"id": "x", "object": kind, "model": body.get("model"), "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: dict) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        if chat:
            await send({"id": "x", "object": kind + ".chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i, word in enumerate(out):
            if i:
                await asyncio.sleep(self.a.decode_ms / 1e3)
            if self.aborting:
                await send({"id": "x", "object": kind, "choices": [{"index": 0, "text": "", "finish_reason": "abort"}]})
                break
            piece = (" " if i or not chat else "") + word
            last = i == len(out) - 1
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            if last:
                choice["finish_reason"] = "length"
            await send({"id": "x", "object": kind + (".chunk" if chat else ""), "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({"id": "x", "object": kind, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.finish(tokens, out)
        return resp

    def finish(self, tokens: list[str], out: list[str]) -> None:
        self.cache.insert(tokens + out[:-1])  # the last token's KV is never computed
        self.counters["request_success"] += 1
        self.counters["generation_tokens"] += len(out)

    async def metrics(self, _request) -> web.Response:
        lab = 'engine="0",model_name="m"'
        lines = [f"vllm:num_requests_running{{{lab}}} {self.running}", f"vllm:num_requests_waiting{{{lab}}} {self.waiting}",
                 f"vllm:kv_cache_usage_perc{{{lab}}} {len(self.cache.blocks) / max(1, self.cache.capacity)}"]
        for k, v in self.counters.items():
            name = k if k.startswith("time_to_first") else k + "_total"
            extra = ',finished_reason="length"' if k == "request_success" else ""
            lines.append(f"vllm:{name}{{{lab}{extra}}} {float(v)}")
        return web.Response(text="\n".join(lines) + "\n")

    async def reset(self, _request) -> web.Response:
        if os.environ.get("VLLM_SERVER_DEV_MODE") != "1":
            return web.json_response({"detail": "Not Found"}, status=404)
        self.cache.blocks.clear()
        return web.Response(text="")

    async def tokens(self, request: web.Request) -> web.Response:
        """/tokenize, /v1/completions/render, /v1/chat/completions/render (what vllm-router's cache_aware
        asks for token ids), in vLLM's shapes: ids are the words' numbers (wN -> N)."""
        body = await request.json()
        ids = [int(w[1:]) if w[1:].isdigit() else 2 for w in prompt_tokens(body, "messages" in body)]
        if request.path == "/tokenize":
            return web.json_response({"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None})
        item = {"request_id": "render", "token_ids": ids or [2]}
        return web.json_response([item] if request.path == "/v1/completions/render" else item)

    async def sleep(self, request: web.Request) -> web.Response:
        level = int(request.query.get("level", "1"))
        if request.query.get("mode", "abort") == "abort":
            self.aborting = True
        self.awake.clear()
        while self.running:  # mode=wait: the streams in flight finish; abort: they end at their next token
            await asyncio.sleep(0.01)
        self.aborting = False
        await asyncio.sleep(self.a.sleep_ms / 1e3)
        if level >= 1:
            self.asleep_tags = {"weights", "kv_cache"}
            self.cache.blocks.clear()
        return web.Response(text="")

    async def wake_up(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", []) or ["weights", "kv_cache"]
        await asyncio.sleep(self.a.sleep_ms / 1e3)
        self.asleep_tags -= set(tags)
        if not self.asleep_tags:
            self.awake.set()
        return web.Response(text="")

    async def is_sleeping(self, _request) -> web.Response:
        return web.json_response({"is_sleeping": not self.awake.is_set()})

    async def rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(self.a.sleep_ms / 1e3)
        return web.json_response({"results": [None]}) if body.get("method") else web.json_response({}, status=400)

    async def models(self, _request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.a.served_model_name, "object": "model",
                                                              "max_model_len": 2048, "owned_by": "vllm"}]})


@web.middleware
async def log_unknown(request, handler):
    try:
        return await handler(request)
    except web.HTTPNotFound:
        print(f"vllm_standin: {request.method} {request.path}: not served (404)", flush=True)
        raise


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["serve"])
    ap.add_argument("model")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default="m")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--enable-prompt-tokens-details", action="store_true")
    ap.add_argument("--prefill-us", type=float, default=float(os.environ.get("STANDIN_PREFILL_US", 20)))
    ap.add_argument("--decode-ms", type=float, default=float(os.environ.get("STANDIN_DECODE_MS", 2)))
    ap.add_argument("--enable-sleep-mode", action="store_true")
    ap.add_argument("--sleep-ms", type=float, default=float(os.environ.get("STANDIN_SLEEP_MS", "300")))
    a, ignored = ap.parse_known_args()
    engine = Engine(a)
    print(f"vllm_standin: ignoring {' '.join(ignored)}", flush=True)
    print(f"INFO GPU KV cache size: {engine.kv_tokens:,} tokens", flush=True)
    app = web.Application(middlewares=[log_unknown])
    app.add_routes([web.post("/v1/completions", engine.complete), web.post("/v1/chat/completions", engine.complete),
                    web.get("/metrics", engine.metrics), web.post("/reset_prefix_cache", engine.reset),
                    web.post("/tokenize", engine.tokens), web.post("/v1/completions/render", engine.tokens),
                    web.post("/v1/chat/completions/render", engine.tokens), web.get("/v1/models", engine.models), web.get("/health", lambda r: web.Response(text=""))])
    if a.enable_sleep_mode and os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
        app.add_routes([web.post("/sleep", engine.sleep), web.post("/wake_up", engine.wake_up),
                        web.get("/is_sleeping", engine.is_sleeping), web.post("/collective_rpc", engine.rpc)])
    web.run_app(app, host=a.host, port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    sys.exit(main())
