"""`hpcserve monitor NAME`: one small HTTP server (stdlib) over a Gatherer.

    /            the dashboard (static/dashboard.html), which polls /api/status every 2 s
    /api/status  the current Snapshot as JSON
    /metrics     Prometheus exposition: hpcserve_* metrics and vLLM's re-exported with deployment/replica labels

Access: it binds 127.0.0.1 by default. /api/status and /metrics require the deployment's API key
(`Authorization: Bearer KEY`) on every address, loopback included: every user of a login node reaches its
loopback, and these numbers name the replicas' addresses, the nodes and the load. The dashboard page itself
holds no data and takes the key from the URL fragment (`/#key=...`, never sent to a server or written to
its log). Only a deployment without a key (serve.insecure_no_api_key, a machine of one's own) is open.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from hpcserve.core.errors import UsageError
from hpcserve.core.keys import KeyCheck
from hpcserve.monitoring.metrics import Gatherer
from hpcserve.monitoring.prometheus import DeploymentCollector


def dashboard_html() -> bytes:
    return resources.files("hpcserve.monitoring").joinpath("static/dashboard.html").read_bytes()


def authorized(header: str | None, key: str | None) -> bool:
    """Whether an Authorization header carries the key (always, when there is no key). Pure."""
    return KeyCheck(key).allows(header)


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


class MonitorServer:
    """The server, built but not yet serving: `serve_forever()` or `start()` (a thread, for tests)."""

    def __init__(self, gatherer: Gatherer, host: str = "127.0.0.1", port: int = 9400, api_key: str | None = None):
        self.gatherer = gatherer
        self.key = api_key  # on loopback too: other users of this machine reach it
        self.check = KeyCheck(api_key)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DeploymentCollector(gatherer))
        self.page = dashboard_html()
        server_class = _IPv6Server if ":" in host else _Server
        try:
            self.httpd = server_class((host, port), self._handler())
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}; choose another with --port") from None

    @property
    def url(self) -> str:
        host, port = self.httpd.socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        try:
            self.httpd.serve_forever()
        finally:
            self.httpd.server_close()
            self.gatherer.close()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self.httpd.shutdown()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name
                path = self.path.split("?", 1)[0]
                if path in ("/", "/index.html"):
                    return self._send(200, "text/html; charset=utf-8", server.page)
                if path not in ("/api/status", "/metrics"):
                    return self._send(404, "text/plain", b"not found: try /, /api/status or /metrics\n")
                if not server.check.allows(self.headers.get("Authorization")):
                    return self._send(401, "text/plain", b"this monitor needs the deployment's API key: "
                                      b"Authorization: Bearer KEY\n", {"WWW-Authenticate": "Bearer"})
                if path == "/metrics":
                    return self._send(200, CONTENT_TYPE_LATEST, generate_latest(server.registry))
                body = json.dumps(server.gatherer.snapshot().to_json(), default=str).encode()
                return self._send(200, "application/json", body)

            def _send(self, code: int, ctype: str, body: bytes, extra: dict | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                for key, value in (extra or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # quiet: polled every 2 s
                pass

        return Handler
