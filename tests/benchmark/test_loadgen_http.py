"""The load generator over real HTTP (aiohttp) against a fake OpenAI server on loopback: streaming, failures
recorded not raised, timeouts, the run deadline, the concurrency limit, keep-alive, round-robin, discovery."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from hpcserve.benchmark.bench import (
    BenchmarkError,
    BenchOptions,
    discover_model,
    run_benchmark,
)
from hpcserve.benchmark.loadgen import (
    LoadShape,
    Repeated,
    RequestInput,
    make_session,
    run_load,
    send_request,
)
from hpcserve.engine.client import Endpoint


class FakeServer:
    """`/v1/completions` streams one `choices` chunk per token, then usage and [DONE]; a request with
    stream false gets the whole answer; `/v1/chat/completions` answers the same, in chat's shape.

    A text prompt (else the model name) picks a mode: "404", "error" (an error event mid-stream), "stall"."""

    def __init__(self, name: str = "fake", token_delay_s: float = 0.0):
        self.name, self.token_delay_s = name, token_delay_s
        self.bodies: list[dict] = []
        self.peers: set = set()
        self.in_flight = self.max_in_flight = 0
        self.auth: list[str | None] = []
        self.session_ids: list[str | None] = []
        self.release = asyncio.Event()  # ends stalls when the server shuts down

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        self.peers.add(request.transport.get_extra_info("peername"))
        self.session_ids.append(request.headers.get("x-session-id"))
        chat = "messages" in body
        mode = body.get("prompt") if isinstance(body.get("prompt"), str) else body["model"]
        if mode == "404":
            return web.Response(status=404, text="The model `x` does not exist.")
        usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": 5}}
        if not body.get("stream"):
            text = " ".join(f"t{index}" for index in range(body["max_tokens"]))
            choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            return web.json_response({"choices": [choice], "usage": usage})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b": ping\n\n")
            for index in range(body["max_tokens"]):
                if mode == "stall" and index == 1:
                    await self.release.wait()
                if mode == "error" and index == 1:
                    await response.write(b'data: {"error": {"message": "boom"}}\n\n')
                    return response
                await asyncio.sleep(self.token_delay_s)
                piece = "" if index == 0 else f"t{index}"
                choice = {"delta": {"content": piece}} if chat else {"text": piece}
                chunk = json.dumps({"choices": [choice]}).encode()
                # split a line across writes: the client must join it
                await response.write(b"data: " + chunk[:5])
                await response.write(chunk[5:] + b"\n\n")
            await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            self.in_flight -= 1

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": self.name}]})


@asynccontextmanager
async def serving(*servers: FakeServer):
    runners, urls = [], []
    try:
        for server in servers:
            app = web.Application()
            app.router.add_post("/v1/completions", server.completions)
            app.router.add_post("/v1/chat/completions", server.completions)
            app.router.add_get("/v1/models", server.models)
            runner = web.AppRunner(app, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        yield urls
    finally:
        for server in servers:
            server.release.set()
        for runner in runners:
            await runner.cleanup()


def one_request(prompt: str | list[int], timeout_s: float = 10.0, base_url: str | None = None):
    async def go():
        async with serving(FakeServer()) as (url,), make_session(LoadShape(1), timeout_s) as session:
            return await send_request(session, Endpoint(base_url or url, "m", "key"), RequestInput(prompt, 4),
                                      ignore_eos=True, run_start=0.0)
    return asyncio.run(go())


def test_a_streamed_request_is_timed_from_its_chunks():
    out = one_request([1, 2, 3])
    assert out.ok, out.error
    assert out.output_tokens == 4 and out.prompt_tokens == 7 and len(out.itl_s) == 3
    assert 0 < out.ttft_s <= out.e2e_s


@pytest.mark.parametrize("prompt, message", [("404", "HTTP 404: The model `x` does not exist."),
                                             ("error", "server error in stream"),
                                             ("stall", "TimeoutError")])
def test_failures_are_recorded_not_raised(prompt, message):
    out = one_request(prompt, timeout_s=0.5)
    assert not out.ok and message in out.error


def test_an_unreachable_server_is_a_recorded_failure():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening: refused
        out = one_request([1], base_url=closed)
    assert not out.ok and "ClientConnectorError" in out.error


def test_concurrency_limits_connections_and_they_are_kept_alive():
    server = FakeServer(token_delay_s=0.005)

    async def go():
        async with serving(server) as (url,):
            inputs = [RequestInput([1, 2], 3) for _ in range(12)]
            return await run_load([Endpoint(url, "m", None)], inputs, LoadShape(concurrency=3), [0.0] * 12,
                                  timeout_s=30)

    before = time.time()
    result = asyncio.run(go())
    assert before <= result.started_at <= time.time()  # epoch seconds: lines the run up with other records
    assert all(o.ok for o in result.outputs) and len(result.outputs) == 12
    assert server.max_in_flight <= 3
    assert len(server.peers) <= 3  # 12 requests over at most 3 kept-alive connections


def test_requests_go_round_robin_with_each_endpoints_model_and_key():
    servers = [FakeServer("a"), FakeServer("b")]

    async def go():
        async with serving(*servers) as urls:
            endpoints = [Endpoint(urls[0], "model-a", "key-a"), Endpoint(urls[1], "model-b", None)]
            return await run_load(endpoints, [RequestInput([1], 2)] * 5, LoadShape(concurrency=2), [0.0] * 5,
                                  timeout_s=30)

    assert all(o.ok for o in asyncio.run(go()).outputs)
    assert [b["model"] for b in servers[0].bodies] == ["model-a"] * 3 and servers[0].auth == ["Bearer key-a"] * 3
    assert [b["model"] for b in servers[1].bodies] == ["model-b"] * 2 and servers[1].auth == [None] * 2


def test_the_run_deadline_fails_what_is_left_and_keeps_one_output_per_input():
    async def go():
        async with serving(FakeServer()) as (url,):
            inputs = [RequestInput("stall", 4), RequestInput([1], 2), RequestInput([1], 2)]
            return await run_load([Endpoint(url, "m", None)], inputs, LoadShape(concurrency=1), [0.0, 0.0, 60.0],
                                  timeout_s=0.5)

    outputs = asyncio.run(go()).outputs
    assert len(outputs) == 3 and not any(o.ok for o in outputs)
    assert all("deadline" in o.error or "TimeoutError" in o.error for o in outputs)
    assert "deadline" in outputs[2].error


def test_a_whole_answer_a_chat_and_a_request_header():
    server = FakeServer()
    chat = [{"role": "user", "content": "hi"}]

    async def go():
        async with serving(server) as (url,), make_session(LoadShape(1), 10) as session:
            endpoint = Endpoint(url, "m", None)
            return [await send_request(session, endpoint, request, True, 0.0) for request in
                    (RequestInput("x", 3, stream=False), RequestInput(chat, 3, headers={"x-session-id": "s1"}),
                     RequestInput(chat, 2, stream=False, temperature=0.0))]

    whole, streamed_chat, whole_chat = asyncio.run(go())
    assert whole.ok and whole.ttft_s == whole.e2e_s and whole.text == "t0 t1 t2" and whole.output_tokens == 3
    assert streamed_chat.ok and streamed_chat.text == "t1t2" and streamed_chat.cached_tokens == 5
    assert whole_chat.text == "t0 t1" and server.bodies[2]["temperature"] == 0.0
    assert server.session_ids == [None, "s1", None]
    assert "stream_options" not in server.bodies[0] and "messages" in server.bodies[1]


def test_a_send_window_stops_sending_and_lets_the_sent_finish():
    server = FakeServer(token_delay_s=0.01)

    async def go():
        async with serving(server) as (url,):
            return await run_load([Endpoint(url, "m", None)], Repeated(RequestInput([1], 3), 10**9),
                                  LoadShape(concurrency=2), Repeated(0.0, 10**9), timeout_s=30, send_window_s=0.3)

    result = asyncio.run(go())
    assert 2 <= len(result.outputs) < 1000 and all(o.ok for o in result.outputs)
    assert result.sent == list(range(len(result.outputs))) and server.max_in_flight <= 2


def test_run_benchmark_discovers_the_model_warms_up_and_summarises():
    server = FakeServer("served-name")

    async def go():
        async with serving(server) as (url,):
            return await asyncio.to_thread(
                run_benchmark, [Endpoint(url, None, None)],
                BenchOptions(loads=(LoadShape(2), LoadShape(None, math.inf)), num_prompts=6, output_len=3,
                             timeout_s=30), command=["x"])

    result = asyncio.run(go())
    assert {b["model"] for b in server.bodies} == {"served-name"} and len(server.bodies) == 1 + 6 + 6
    assert [run.summary.completed for run in result.runs] == [6, 6]


def test_a_failing_warm_up_stops_the_benchmark_with_the_servers_answer():
    async def go():
        async with serving(FakeServer()) as (url,):
            await asyncio.to_thread(run_benchmark, [Endpoint(url, "404", None)],
                                    BenchOptions(dataset=None, num_prompts=1, timeout_s=10), command=["x"])

    with pytest.raises(BenchmarkError, match="warm-up request .* failed: HTTP 404"):
        asyncio.run(go())


def test_model_discovery_failure_names_the_url():
    async def go():
        async with serving(FakeServer()) as (url,):
            return await discover_model(Endpoint(url + "/nowhere", None, None), timeout_s=5)

    with pytest.raises(BenchmarkError, match="/nowhere/v1/models"):
        asyncio.run(go())
