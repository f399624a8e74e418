"""One stable OpenAI endpoint in front of every replica: vllm-router's data plane, hpcserve's control.

    router = Router(host, port, api_key_file, log_path)
    router.start(["http://10.0.0.5:8000", ...])   # own process group; returns once it answers
    router.add(url)                 # a replica that already answered a real completion joins
    router.remove(url, drain_s=30)  # no new requests; waits for its in-flight ones to finish
    router.apply(add=[...], remove=[...])   # one round's changes at once
    router.backends()               # [Backend(url, healthy, in_flight)]
    router.stop()                   # SIGTERM to its process group by recorded PID, then SIGKILL

What the data plane (vllm-router, Rust) does: proxying, streaming passed through chunk by chunk, the
client's key checked at the router on every route (through router_main's validator, cached per token)
and passed on to the engines, retries of failed requests on another backend (connection errors,
408/429/5xx) with backoff, per-backend circuit breakers, /health checks, the backend choice (round_robin
by default; power_of_two balances the router's in-flight counts, see router_main.POLICIES), its own
Prometheus metrics, membership changes at run time (/add_worker, /remove_worker) that leave in-flight
requests running.
What we write by hand (neither vllm-router nor sglang-router does it): starting it without the key on a
command line and checking that key (router_main), deciding membership (the control plane calls
add/remove after a real completion probe), waiting for a removed backend to drain, load-aware choice
from vLLM's /metrics (engine_load, backends_to_pause: both routers read sglang's /get_load, which vLLM
does not have), and stopping the process by recorded PID. docs/benchmarks/router.md compares the two data planes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import httpx
import psutil

from hpcserve.core.errors import HpcserveError
from hpcserve.core.keys import bearer
from hpcserve.core.net import free_loopback_port, url_host
from hpcserve.engine.client import completion_probe, health_ok
from hpcserve.engine.metrics import EngineLoad, engine_load, is_drained

LAUNCHER = "hpcserve.endpoint.router_main"
PROCESS_TITLE = "hpcserve-router"  # router_main sets it: `ps` shows which process is the router
POLL_S = 0.1
ADMIN_CALLS_AT_ONCE = 16  # apply(): membership changes sent to the router at once


class RouterError(HpcserveError):
    """The router did not start, or refused or failed a membership change."""


# ------------------------------------------------------------------ the router process

@dataclass(frozen=True)
class Backend:
    url: str
    healthy: bool
    in_flight: int  # requests the router has sent there and not finished


def backends_from_json(data: dict) -> list[Backend]:
    """The router's GET /workers answer. Pure."""
    return [Backend(w["url"], bool(w.get("is_healthy")), max(0, int(w.get("load") or 0)))
            for w in data.get("workers", [])]


def launcher_argv(host: str, port: int, metrics_port: int, api_key_file: Path | None, policy: str,
                  backends: Iterable[str] = (), python: str = sys.executable) -> list[str]:
    """The router's command line: no secret on it (the key is read from its 0600 file)."""
    argv = [python, "-m", LAUNCHER, "--host", host, "--port", str(port), "--metrics-port", str(metrics_port),
            "--policy", policy]
    for url in backends:
        argv += ["--backend", url.rstrip("/")]
    return argv + (["--api-key-file", str(api_key_file)] if api_key_file else [])


class Router:
    """The router process and its admin API. One controller drives it; its membership calls may come
    from two threads at once (the controller's round and its join thread), each about other backends."""

    def __init__(self, host: str, port: int, api_key_file: Path | None, log_path: Path, model: str | None = None,
                 policy: str = "round_robin", metrics_port: int | None = None, python: str = sys.executable):
        """api_key_file: a mode-0600 file with the key clients must send (and the engines expect); None
        leaves the endpoint open. model: the served name, for probe()."""
        self.host, self.port, self.policy, self.model = host, port, policy, model
        self.api_key_file = Path(api_key_file) if api_key_file else None
        self.log_path = Path(log_path)
        self.metrics_port = metrics_port or free_loopback_port()
        self.python = python
        self.pid: int | None = None
        self._process: psutil.Popen | None = None
        self._key: str | None = None
        # Shared by the admin calls of apply(), which run in threads (httpx's Client is thread-safe)
        self._client = httpx.Client(timeout=httpx.Timeout(10.0, connect=2.0), trust_env=False,
                                    limits=httpx.Limits(max_connections=ADMIN_CALLS_AT_ONCE + 4))
        self._executor = ThreadPoolExecutor(ADMIN_CALLS_AT_ONCE, thread_name_prefix="router-admin")

    @property
    def url(self) -> str:
        """The router's base URL; the OpenAI base URL is url + '/v1'."""
        return f"http://{url_host(self.host)}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """The router's own Prometheus metrics: on loopback only (no key check there)."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    # -------------------------------------------------------------- lifecycle

    def start(self, backends: Iterable[str] = (), timeout_s: float = 60.0) -> None:
        """Start the router (its own process group) with `backends` (engines that already answered a real
        completion), and return once it answers and routes to them."""
        backends = [url.rstrip("/") for url in backends]
        if self.policy == "power_of_two" and len(backends) < 2:
            raise RouterError("policy power_of_two needs at least 2 backends at start (vllm-router refuses "
                              "fewer): start with them, or use round_robin")
        self._key = self.api_key_file.read_text().strip() if self.api_key_file else None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = launcher_argv(self.host, self.port, self.metrics_port, self.api_key_file, self.policy, backends,
                             self.python)
        with open(self.log_path, "ab") as log:
            self._process = psutil.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        self.pid = self._process.pid
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self._process.poll() is not None:
                raise RouterError(f"the router exited with code {self._process.returncode} at start; "
                                  f"its log: {self.log_path}: {_tail(self.log_path)}")
            if time.monotonic() > deadline:
                self.stop()
                raise RouterError(f"the router did not answer on {self.url} within {timeout_s:.0f} s; "
                                  f"its log: {self.log_path}")
            time.sleep(POLL_S)

    def alive(self) -> bool:
        return self.pid is not None and _is_router(self.pid)

    def probe(self, timeout_s: float = 60.0) -> str:
        """A real completion through the router (needs `model`); its text. Raises httpx errors or
        RuntimeError, like readiness.completion_probe."""
        if not self.model:
            raise RouterError("probe() needs the served model name: Router(..., model=NAME)")
        return completion_probe(self.url, self.model, self._key, timeout_s=timeout_s)

    def ready(self) -> bool:
        """At least one healthy backend (the router's /readiness)."""
        try:
            return self._client.get(f"{self.url}/readiness", headers=self._auth()).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.pid is not None:
            stop_router(self.pid, timeout_s)
        if self._process is not None:
            try:
                self._process.wait(timeout=1)  # reap it: no zombie left behind
            except psutil.TimeoutExpired:
                pass
        self.pid, self._process = None, None

    def close(self) -> None:
        self._executor.shutdown(wait=False)
        self._client.close()

    # -------------------------------------------------------------- membership

    def backends(self) -> list[Backend]:
        response = self._admin("GET", "/workers")
        return backends_from_json(response.json())

    def add(self, url: str, timeout_s: float = 30.0) -> None:
        """Add a backend and wait until the router routes to it. Call it only for an engine that already
        answered a real completion (readiness.completion_probe): the router checks /health alone."""
        url = url.rstrip("/")
        if any(b.url == url for b in self.backends()):
            return
        if not health_ok(url):  # else vllm-router would hold the call for its whole startup timeout (30 s)
            raise RouterError(f"{url} does not answer /health: not added to the router")
        # vllm-router answers once the backend passed its /health (or refuses after its startup timeout)
        self._admin("POST", "/add_worker", params={"url": url}, timeout=timeout_s + 5)
        self._wait(lambda: any(b.url == url and b.healthy for b in self.backends()), timeout_s,
                   f"the router did not take {url} within {timeout_s:.0f} s (see {self.log_path})")

    def apply(self, add: Iterable[str] = (), remove: Iterable[str] = (), timeout_s: float = 30.0) -> set[str]:
        """One round's membership changes at once: the adds together, then (once the router routes to
        them) the removes together, with one look at /workers before and one wait after, instead of
        one add or remove after the other with a wait each (~60 ms an add here: seconds for a round
        that changes dozens). Adds first, so the router is never left without a backend in between.
        No drain wait: the controller drains itself. Returns the backends that could not be added
        (they did not answer /health, or the router did not take them within timeout_s)."""
        present = {b.url for b in self.backends()}
        adds = [u.rstrip("/") for u in add if u.rstrip("/") not in present]
        removes = [u.rstrip("/") for u in remove if u.rstrip("/") in present]
        refused = {url for url, ok in zip(adds, self._pool().map(self._request_add, adds, [timeout_s] * len(adds)))
                   if not ok}
        if adds:
            wanted = set(adds) - refused
            seen = self._wait_for_workers(lambda w: wanted <= {b.url for b in w if b.healthy}, timeout_s)
            refused |= wanted - {b.url for b in seen if b.healthy}
        if removes:
            list(self._pool().map(lambda url: self._admin("POST", "/remove_worker", params={"url": url}), removes))
            gone = set(removes)
            self._wait_for_workers(lambda w: not gone & {b.url for b in w}, 10.0)
        return refused

    def _request_add(self, url: str, timeout_s: float) -> bool:
        if not health_ok(url):  # else vllm-router holds the call for its whole startup timeout (30 s)
            return False
        try:
            self._admin("POST", "/add_worker", params={"url": url}, timeout=timeout_s + 5)
            return True
        except RouterError:
            return False

    def _wait_for_workers(self, condition, timeout_s: float) -> list[Backend]:
        """Poll /workers until condition(workers) holds or timeout_s passes; the last answer."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.backends()
            if condition(workers) or time.monotonic() > deadline:
                return workers
            time.sleep(POLL_S / 2)

    def _pool(self) -> ThreadPoolExecutor:
        return self._executor

    def remove(self, url: str, drain_s: float = 30.0) -> bool:
        """Take a backend out: no new requests go there at once; then wait up to drain_s for the requests
        it still runs (its vLLM /metrics) to finish. True when it drained, False when drain_s ran out or
        it no longer answers (a dead engine has nothing left to drain)."""
        url = url.rstrip("/")
        self._admin("POST", "/remove_worker", params={"url": url})
        self._wait(lambda: all(b.url != url for b in self.backends()), 10.0,
                   f"the router did not remove {url} within 10 s (see {self.log_path})")
        deadline = time.monotonic() + drain_s
        while True:
            load = self.engine_load(url)
            if load is None or is_drained(load):
                return load is not None
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)

    def engine_load(self, url: str, timeout_s: float = 2.0) -> EngineLoad | None:
        """An engine's load from its /metrics; None when it does not answer."""
        try:
            response = self._client.get(f"{url.rstrip('/')}/metrics", headers=self._auth(), timeout=timeout_s)
            return engine_load(response.text) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    # -------------------------------------------------------------- helpers

    def _auth(self) -> dict[str, str]:
        return bearer(self._key)

    def _admin(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = self._client.request(method, f"{self.url}{path}", headers=self._auth(), **kwargs)
        except httpx.HTTPError as exc:
            raise RouterError(f"the router at {self.url} did not answer {method} {path}: {exc}") from exc
        if response.status_code >= 400:
            raise RouterError(f"the router refused {method} {path}: HTTP {response.status_code} {response.text[:200]}")
        return response

    def _answers(self) -> bool:
        try:
            return self._client.get(f"{self.url}/liveness", headers=self._auth(), timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    @staticmethod
    def _wait(condition, timeout_s: float, message: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise RouterError(message)
            time.sleep(POLL_S)


def stop_router(pid: int, timeout_s: float = 10.0) -> bool:
    """Stop a router by its recorded PID (another process may do it, e.g. `hpcserve down`): SIGTERM to
    its process group, SIGKILL after timeout_s. Does nothing when that PID is no router of ours (gone,
    or reused by another program). True when a router was stopped."""
    if not _is_router(pid):
        return False
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return True
        try:
            psutil.Process(pid).wait(timeout=wait_s)
            return True
        except psutil.TimeoutExpired:
            continue
        except psutil.NoSuchProcess:
            return True
    return not psutil.pid_exists(pid)


def _is_router(pid: int) -> bool:
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        cmdline = " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return LAUNCHER in cmdline or cmdline.startswith(PROCESS_TITLE)






def _tail(path: Path, chars: int = 400) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return "(no log)"
