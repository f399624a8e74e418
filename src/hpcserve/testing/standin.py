"""A fast OpenAI-compatible stand-in backend: fixed completions (plain and SSE), /health, /v1/models,
and a vLLM-style /metrics. It exists so that the router's own overhead can be measured where an engine's
noise would hide a 1 ms difference, and so that drain/retry behaviour can be checked at exact moments.

    python -m hpcserve.testing.standin --port P [--name N] [--token-delay-ms D] [--tokens K] [--slots S]

Each response names the backend that answered (`system_fingerprint`, header `x-backend`), and the
backend counts what it served (GET /stub/stats), so tests can see where requests went. With --slots S
it runs at most S requests at once and queues the rest, as an engine with `--max-num-seqs S` does: two
stubs with different slots stand for replicas of different capacity. The prompts __answer_400__ and
__answer_500__ get a client error and an engine error.
When HPCSERVE_STUB_API_KEY is set, requests without `Authorization: Bearer <key>` get 401, as vLLM does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from aiohttp import web

STATS = web.AppKey("stats", dict)
SLOTS = web.AppKey("slots", asyncio.Semaphore)
BAD_PROMPT = "__answer_400__"
FAILING_PROMPT = "__answer_500__"
CONFIG = web.AppKey("config", dict)


def completion_body(name: str, chat: bool, text: str, tokens: int) -> dict:
    """A whole (non-streamed) OpenAI completion. Pure."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
              if chat else {"index": 0, "text": text, "finish_reason": "length"})
    return {"id": "cmpl-stub", "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": "stub", "system_fingerprint": name, "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}}


def chunk_line(name: str, chat: bool, text: str) -> bytes:
    """One SSE `data:` event carrying one token. Pure."""
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    body = {"id": "cmpl-stub", "object": "chat.completion.chunk" if chat else "text_completion",
            "model": "stub", "system_fingerprint": name, "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _authorized(request: web.Request) -> bool:
    key = request.app[CONFIG]["api_key"]
    return not key or request.headers.get("Authorization") == f"Bearer {key}"


async def _complete(request: web.Request) -> web.StreamResponse:
    stats = request.app[STATS]
    if not _authorized(request):
        return web.json_response({"error": "Unauthorized"}, status=401)
    body = await request.json()
    chat = request.path.endswith("/chat/completions")
    stats["last_body"] = body  # what the router forwarded (it re-serialises typed requests)
    if body.get("prompt") == BAD_PROMPT:  # a client error, as vLLM answers a bad request
        return web.json_response({"error": {"message": "bad request", "code": 400}}, status=400)
    if body.get("prompt") == FAILING_PROMPT:  # an engine error, as vLLM answers when generation fails
        stats["failed"] += 1
        return web.json_response({"error": {"message": "engine error", "code": 500}}, status=500)
    stats["requests"] += 1
    stats["waiting"] += 1
    async with request.app[SLOTS]:
        stats["waiting"] -= 1
        return await _answer(request, body, chat)


async def _answer(request: web.Request, body: dict, chat: bool) -> web.StreamResponse:
    config, stats = request.app[CONFIG], request.app[STATS]
    tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or config["tokens"])
    name, delay = config["name"], config["token_delay_s"]
    stats["in_flight"] += 1
    try:
        if not body.get("stream"):
            if delay:
                await asyncio.sleep(delay * tokens)
            return web.json_response(completion_body(name, chat, "x" * tokens, tokens), headers={"x-backend": name})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-backend": name})
        await response.prepare(request)
        for _ in range(tokens):
            if delay:
                await asyncio.sleep(delay)
            await response.write(chunk_line(name, chat, "x"))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "cmpl-stub", "model": "stub", "choices": [],
                     "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}}
            await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:
        stats["in_flight"] -= 1
        stats["done"] += 1


async def _models(request: web.Request) -> web.Response:
    if not _authorized(request):
        return web.json_response({"error": "Unauthorized"}, status=401)
    return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model", "owned_by": "hpcserve"}]})


async def _metrics(request: web.Request) -> web.Response:
    stats = request.app[STATS]
    text = ("# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="stub"}} {stats["in_flight"]}\n'
            "# HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="stub"}} {stats["waiting"]}\n'
            "# HELP vllm:kv_cache_usage_perc KV.\n# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{model_name="stub"} 0.0\n')
    return web.Response(text=text, content_type="text/plain")


async def _ok(_request: web.Request) -> web.Response:
    return web.Response(text="")


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATS])


async def _name_every_response(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.setdefault("x-backend", request.app[CONFIG]["name"])  # 404s and /v1/models too


def make_app(name: str, token_delay_s: float = 0.0, tokens: int = 16, api_key: str | None = None,
             slots: int = 1_000_000) -> web.Application:
    app = web.Application()
    app[SLOTS] = asyncio.Semaphore(slots)
    app[CONFIG] = {"name": name, "token_delay_s": token_delay_s, "tokens": tokens, "api_key": api_key}
    app.on_response_prepare.append(_name_every_response)
    app[STATS] = {"requests": 0, "waiting": 0, "in_flight": 0, "done": 0, "failed": 0, "last_body": None}
    app.add_routes([web.post("/v1/completions", _complete), web.post("/v1/chat/completions", _complete),
                    web.get("/v1/models", _models), web.get("/health", _ok), web.get("/metrics", _metrics),
                    web.get("/stub/stats", _stats)])
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="stub")
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--slots", type=int, default=1_000_000, help="requests run at once; the rest wait")
    args = parser.parse_args(argv)
    app = make_app(args.name, args.token_delay_ms / 1000.0, args.tokens, os.environ.get("HPCSERVE_STUB_API_KEY"),
                   args.slots)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
