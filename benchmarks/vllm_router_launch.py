"""vllm-router 0.1.17, hpcserve's data plane until 2026-12 (benchmarks/results/router.md says why it was
replaced), kept for the benchmarks that compare the two: started through its Python binding with the
settings hpcserve ran it with, and driven as the endpoint drove it (VllmRouter).

    python benchmarks/vllm_router_launch.py --api-key-file FILE --host H --port P --metrics-port M [...]

vllm-router is a dev dependency now (pip install -e .[dev]). Why the launcher was ours:
- The key must never be on a command line (every user of a shared node can read process lists), and
  vllm-router's launcher takes secrets only as arguments. The binding takes the same settings from Python.
- vllm-router checks client keys only through `api_key_validation_urls`: for each new bearer token it asks
  those URLs (200 = valid) and caches the answer, so every later request costs a map lookup. We answer
  that question ourselves, in this process, from the 0600 key file: a loopback validator that only the
  router calls, once per distinct token. It covers every route (completions, chat, /v1/models, and the
  admin API /add_worker, /remove_worker, /workers), so nobody without the key can change membership.
- Proxy variables are dropped: the router must reach the engines directly, never through a site proxy.
"""

from __future__ import annotations

import argparse
import hmac
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from hpcserve.core.keys import read_key_file
from hpcserve.testing.harness import spawn, stop, wait_until

VALIDATE_PATH = "/validate"
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")

# vllm-router's policies that fit a pool of vLLM replicas. None of them reads vLLM's /metrics (they read
# sglang's /get_load, which vLLM lacks, or the router's own in-flight counts); load from /metrics is the
# control plane's business (then: endpoint.control.rotation). Measured costs: benchmarks/results/router.md.
POLICIES = {
    "round_robin": {},  # the cheapest; the default
    "power_of_two": {},  # two random backends, the one with fewer requests in flight through the router;
                         # vllm-router refuses it with fewer than 2 backends at start
    "cache_aware": {},  # prefix-cache affinity, balanced by in-flight counts; costs ~3 ms a request here
    "random": {},
}


def key_matches(authorization: str | None, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time. Pure."""
    expected = f"Bearer {key}".encode()
    return hmac.compare_digest((authorization or "").strip().encode(), expected)


def start_validator(key: str) -> str:
    """A loopback HTTP server answering 200 for the right bearer token, 401 otherwise; returns its URL.

    It runs in a forked child: the Rust router holds the GIL while it serves, so a thread of this
    process would never answer. The child is in the router's process group (stopped with it) and also
    exits when its parent is gone."""

    class Validator(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- http.server's naming
            ok = self.path == VALIDATE_PATH and key_matches(self.headers.get("Authorization"), key)
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:  # tokens in request lines must not reach the log
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Validator)
    url = f"http://127.0.0.1:{server.server_address[1]}{VALIDATE_PATH}"
    parent = os.getpid()
    if os.fork() == 0:  # child: serve until the router (our parent) is gone
        threading.Thread(target=server.serve_forever, daemon=True).start()
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    server.socket.close()
    return url


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="hpcserve's router (vllm-router data plane)")
    parser.add_argument("--api-key-file", type=Path, help="without it, the endpoint is open to anyone")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--policy", choices=sorted(POLICIES), default="round_robin")
    parser.add_argument("--backend", action="append", default=[], help="a backend at start (repeatable)")
    parser.add_argument("--retries", type=int, default=5)
    parser.add_argument("--request-timeout-s", type=int, default=1800)
    parser.add_argument("--health-check-interval-s", type=int, default=5)
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return parser.parse_args(argv)


def router_kwargs(args: argparse.Namespace, api_key: str | None, validation_url: str | None) -> dict:
    """Keyword arguments of vllm-router's binding (vllm_router_rs.Router): upstream defaults, except
    where a comment says why."""
    from vllm_router.router_args import RouterArgs

    settings = RouterArgs(
        worker_urls=list(args.backend),  # engines that already answered a real completion
        host=args.host, port=args.port, policy=args.policy, api_key=api_key,
        # Its metrics name every backend and have no key check: loopback only, and never upstream's
        # fixed port 29000 (two routers on one login node would clash).
        prometheus_host="127.0.0.1", prometheus_port=args.metrics_port,
        request_timeout_secs=args.request_timeout_s, log_level=args.log_level,
        # A retry chooses again among the backends, skipping those whose circuit is open: the breaker
        # must open within one request's retries for a dead backend to cost no request.
        retry_max_retries=args.retries, retry_initial_backoff_ms=20, retry_max_backoff_ms=2000,
        cb_failure_threshold=2, cb_success_threshold=1, cb_timeout_duration_secs=10,
        health_check_interval_secs=args.health_check_interval_s, health_check_timeout_secs=2,
        health_failure_threshold=2, health_success_threshold=1,
        worker_startup_timeout_secs=30, worker_startup_check_interval=1,
        **POLICIES[args.policy],
    )
    kwargs = dict(vars(settings))
    kwargs.pop("mini_lb", None)
    from vllm_router.router import policy_from_str

    for name in ("policy", "prefill_policy", "decode_policy"):
        kwargs[name] = policy_from_str(kwargs[name])
    kwargs["prefill_urls"] = kwargs["decode_urls"] = None
    kwargs["api_key_validation_urls"] = [validation_url] if validation_url else []
    return kwargs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        api_key = read_key_file(args.api_key_file) if args.api_key_file else None
    except (OSError, ValueError) as exc:
        print(f"router: cannot read the API key: {exc}", file=sys.stderr)
        return 2
    if api_key is None:
        print("router: no --api-key-file: the endpoint answers anyone who can reach it", file=sys.stderr)
    for name in PROXY_VARIABLES:
        os.environ.pop(name, None)
    import setproctitle
    from vllm_router_rs import Router

    setproctitle.setproctitle("vllm-router-bench")  # never taken for hpcserve's data plane (router.is_router)
    validation_url = start_validator(api_key) if api_key else None
    Router(**router_kwargs(args, api_key, validation_url)).start()  # blocks until SIGTERM/SIGINT
    return 0


class VllmRouter:
    """vllm-router started by this file with fixed backends, stopped by its recorded process group."""

    def __init__(self, port: int, api_key_file: Path | None, log: Path, policy: str = "round_robin",
                 metrics_port: int = 0):
        self.port, self.api_key_file, self.log, self.policy = port, api_key_file, log, policy
        self.metrics_port = metrics_port or port + 1
        self.proc: subprocess.Popen | None = None
        self.key = read_key_file(api_key_file) if api_key_file else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, backends: list[str]) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--host", "127.0.0.1", "--port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--policy", self.policy]
        argv += [arg for url in backends for arg in ("--backend", url)]
        argv += ["--api-key-file", str(self.api_key_file)] if self.api_key_file else []
        self.proc = spawn(argv, self.log)
        auth = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        wait_until(lambda: httpx.get(f"{self.url}/liveness", headers=auth, timeout=1).status_code == 200, 60,
                   f"vllm-router on {self.url} (log: {self.log})")

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None


if __name__ == "__main__":
    sys.exit(main())
