"""endpoint/dataplane/streams.py through the real data plane process (router.Router), in front of two stand-in engines
that stream as vLLM 0.32 does (test_migration.engine: token ids, the detokenizer's lags, chat chunks), one
of which fails mid-stream on cue: the connection dropped, an error event, the stream closed without its end.
The client must get the uninterrupted stream whatever the failure, and the data plane must say what it did.
Real vLLM behind the data plane: tests/endpoint/test_router_vllm.py."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from aiohttp import web
from helpers import free_port
from router_fixtures import KEY, headers, key_file
from test_migration import CHAT_PROMPT, PROMPT, client_body, decode, engine, events_of, summary, uninterrupted

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane import migration as m
from hpcserve.endpoint.control.plane_client import Router
from hpcserve.testing.harness import wait_until

ROUTE = {kind: route for route, kind in m.ROUTES.items()}


class Engines:
    """Two stand-in engines on one event loop in a thread. `failure`: what the next first attempt (a
    client's request, not a continuation) does after `after` events: drop (the connection cut), error (an
    error event, then the end), eof (the stream closed without [DONE]), stall (nothing more until
    release_stall(); `stalled` says which port); `continuation_failure`: what every continuation does."""

    def __init__(self):
        self.failure, self.after, self.continuation_failure = None, 4, None
        self.stalled: int | None = None
        self.unstall: asyncio.Event | None = None
        self.loop = asyncio.new_event_loop()
        self.ports = [free_port(), free_port()]
        self.served: list[tuple[int, str]] = []  # (port, "first" or "continuation")
        ready = threading.Event()
        self.thread = threading.Thread(target=self.run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        runners = []
        for port in self.ports:
            app = web.Application()
            app.add_routes([web.post("/v1/completions", self.answer), web.post("/v1/chat/completions", self.answer),
                            web.post("/detokenize", self.detokenize), web.get("/health", self.health)])
            runner = web.AppRunner(app, access_log=None)
            self.loop.run_until_complete(runner.setup())
            self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
            runners.append(runner)
        ready.set()
        self.loop.run_forever()

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response()

    async def detokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"prompt": decode((await request.json())["tokens"])})

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path == m.CHAT
        continuation = isinstance(body.get("prompt"), list)
        self.served.append((request.url.port, "continuation" if continuation else "first"))
        if chat:
            stream = engine({**body, "prompt_ids": CHAT_PROMPT}, m.Kind.CHAT, rid="chatcmpl-a", created=1)
        else:
            prompt = body["prompt"] if continuation else PROMPT
            stream = engine({**body, "prompt": prompt}, m.Kind.COMPLETION, rid="cmpl-c" if continuation else "cmpl-a",
                            created=9 if continuation else 1)
        failure = self.continuation_failure if continuation else self.failure
        if not continuation:
            self.failure = None  # once: the resend of a dropped request must not fail again
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for number, event in enumerate(events_of(stream)):
            if failure is not None and number == self.after:
                if failure == "drop":
                    request.transport.abort()
                    return response
                if failure == "stall":
                    self.unstall = asyncio.Event()
                    self.stalled = request.url.port
                    await self.unstall.wait()
                    return response
                if failure == "error":
                    await response.write(b'data: {"error": {"message": "EngineCore encountered an issue", '
                                         b'"type": "InternalServerError", "code": 500}}\n\ndata: [DONE]\n\n')
                    return response
                return response  # eof: the stream ends without [DONE]
            await response.write(event)
            await asyncio.sleep(0.002)
        return response

    def release_stall(self) -> None:
        if self.unstall is not None:
            self.loop.call_soon_threadsafe(self.unstall.set)

    def close(self) -> None:
        self.release_stall()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def engines():
    stand_ins = Engines()
    yield stand_ins
    stand_ins.close()


@pytest.fixture(scope="module")
def plane(engines, tmp_path_factory):
    directory = tmp_path_factory.mktemp("streams")
    router = Router("127.0.0.1", free_port(), key_file(directory), directory / "router.log",
                    policy=Routing.ROUND_ROBIN, admin_socket=directory / "admin" / "admin.sock",
                    options=["--failed-s", "1"])  # a dropped replica is skipped 1 s, not 5: each case waits it out
    router.start(engines.urls)
    yield router
    router.stop()
    router.close()


def both_healthy(plane: Router) -> None:
    """A replica whose connection dropped is skipped for a few seconds (settings.failed_s): each case
    starts with both taking requests."""
    wait_until(lambda: all(b.healthy for b in plane.backends()), 10, "both replicas taking requests again")


def client_stream(plane: Router, kind: m.Kind, body: dict) -> bytes:
    """What the client received: the whole stream, or what came before the data plane cut it."""
    received = []
    with httpx.stream("POST", plane.url + ROUTE[kind], json=body, headers=headers(KEY), timeout=60) as response:
        assert response.status_code == 200
        try:
            for data in response.iter_bytes():
                received.append(data)
        except httpx.RemoteProtocolError:  # cut: the response ended before its end
            received.append(b"<cut>")
    return b"".join(received)


@pytest.mark.parametrize("failure", ["drop", "error", "eof"])
@pytest.mark.parametrize("kind", [m.Kind.COMPLETION, m.Kind.CHAT])
def test_a_failing_replica_costs_the_client_nothing(engines, plane, kind, failure):
    both_healthy(plane)
    body = client_body(kind)
    engines.failure, engines.after = failure, 5
    before = len(plane.migrations(0))
    got = summary(client_stream(plane, kind, body), kind)
    want = uninterrupted(kind, body)
    assert {k: got[k] for k in ("text", "ids", "finish", "done")} == {k: want[k] for k in ("text", "ids", "finish", "done")}
    assert len(got["heads"]) == 1  # one id, created, model: one stream
    moved = plane.migrations(0)[before:]
    assert [(m_["cause"], m_["to"] is not None) for m_ in moved] == [(failure if failure == "error" else "broken", True)]


def test_a_stream_with_nowhere_left_to_go_ends_as_before_and_is_counted(engines, plane):
    """The first attempt and its continuation both fail: with both replicas tried, the stream is cut (no
    [DONE]: the client sees it end early, as without migration), and the refusal is on record."""
    both_healthy(plane)
    engines.failure, engines.after, engines.continuation_failure = "drop", 5, "drop"
    try:
        before = len(plane.migrations(0))
        stream = client_stream(plane, m.Kind.COMPLETION, client_body(m.Kind.COMPLETION))
    finally:
        engines.continuation_failure = None
    assert stream.endswith(b"\n\n<cut>") and b"data: [DONE]" not in stream  # whole events only, then cut
    moved = plane.migrations(0)[before:]
    assert [m_["to"] is not None for m_ in moved] == [True, False]
    assert moved[-1]["reason"] == "no other replica can take it"
    assert httpx.get(plane.url + "/health").status_code == 200  # the data plane serves on


def test_a_request_that_cannot_migrate_is_passed_on_as_it_is(engines, plane):
    """logprobs: not migratable; the engine's stream reaches the client unchanged (token id lists stay as
    the engine wrote them, no return_token_ids was asked)."""
    body = client_body(m.Kind.COMPLETION, logprobs=1)
    stream = client_stream(plane, m.Kind.COMPLETION, body)
    sent = [json.loads(e[6:]) for e in events_of(stream) if e.startswith(b"data: {")]
    assert sent and all(c["token_ids"] is None for e in sent for c in e["choices"])


def test_a_handover_moves_a_stream_whose_engine_has_stalled_at_once(engines, plane):
    """A stream whose engine sends nothing more (stalled, or busy prefilling others) moves the moment its
    replica is handed over, as the controller does it (out of the pool, then POST /handover), not at the
    engine's next chunk: before, it waited for a chunk that did not come."""
    both_healthy(plane)
    engines.failure, engines.after, engines.stalled = "stall", 5, None
    before = len(plane.migrations(0))
    body, got = client_body(m.Kind.COMPLETION), {}
    reader = threading.Thread(target=lambda: got.update(summary(client_stream(plane, m.Kind.COMPLETION, body),
                                                                m.Kind.COMPLETION)))
    reader.start()
    stalled = None
    try:
        wait_until(lambda: engines.stalled is not None, 10, "the engine stalled mid-stream")
        stalled = f"http://127.0.0.1:{engines.stalled}"
        plane.remove(stalled, drain_s=0, hand_over=True)
        reader.join(20)
        assert not reader.is_alive(), "the stream still waits for its stalled engine"
    finally:
        engines.release_stall()
        reader.join(20)
        if stalled is not None:
            plane.add(stalled)
    want = uninterrupted(m.Kind.COMPLETION, body)
    assert {k: got[k] for k in ("text", "ids", "finish", "done")} == {k: want[k] for k in ("text", "ids", "finish", "done")}
    moved = plane.migrations(0)[before:]
    assert [(m_["cause"], m_["from"], m_["to"] is not None) for m_ in moved] == [("handover", stalled, True)]
