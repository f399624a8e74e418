"""One stable OpenAI endpoint in front of every replica: hpcserve's data plane process (endpoint/dataplane/),
driven over its admin socket by the controller.

    router = Router(host, port, api_key_file, log_path, admin_socket=paths.router_admin)
    router.start(["http://10.0.0.5:8000", ...])   # own process group; returns once it answers
    router.add(url, capacity=256)   # a replica that already answered a real completion joins
    router.remove(url, drain_s=30)  # no new requests; waits for its in-flight ones to finish
    router.apply(add=[...], remove=[...])   # one round's changes as one update
    router.set_saturated({url})     # engines that queue (from vLLM's /metrics): skipped while others have room
    router.backends()               # [protocol.BackendState(url, healthy, in_flight, capacity, saturated, ...)]
    router.attach(pid)              # a new controller takes over a data plane that kept running
    router.set_waking(Waking(...))  # a model that sleeps when idle: asleep, queued, starting, serving
    router.wakes(after, wait_s)     # requests that found it without a replica (a long poll: returns on one)
    router.stop()                   # SIGTERM to its process group by recorded PID, then SIGKILL

A deployment that joins another's endpoint (serve.join) drives that data plane's room for its own model
only: Router(..., joined=Host(...)). start() registers its model there (PUT /models/NAME) instead of
starting a process, every call is scoped to its model (?model=NAME), and stop() takes its model out
(DELETE /models/NAME) and leaves the data plane and the other models serving.

What it sends and reads is endpoint.protocol's (the admin API, typed once for both rooms).
The controller owns the list: every change sends the whole desired set (PUT /backends, idempotent), so a
lost update is repaired by the next one. The admin socket is a Unix socket in an owner-only folder: only
the owner can change membership; the client port has no admin route. The data plane balances by its own
in-flight counts per unit of each backend's capacity (--max-num-seqs) and KV cache; the controller's part
is what only it sees: membership after a real completion, the engines' /metrics, drains, stopping by PID.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import psutil

from hpcserve.core.errors import HpcserveError
from hpcserve.core.keys import bearer
from hpcserve.core.net import unix_socket_path, url_host
from hpcserve.core.statuses import Routing
from hpcserve.endpoint.protocol import (
    BACKENDS,
    HANDOVER,
    HEALTH,
    METRICS,
    MIGRATIONS,
    MODEL_PARAM,
    MODELS,
    MODULE,
    PROCESS_TITLE,
    WAKING,
    Backends,
    BackendSpec,
    BackendState,
    DesiredBackends,
    HandingOver,
    Handover,
    Health,
    Models,
    ModelSpec,
    Wakes,
    Waking,
)
from hpcserve.engine.capacity import DEFAULT_MAX_NUM_SEQS
from hpcserve.engine.client import completion_probe, health_ok
from hpcserve.engine.metrics import EngineLoad, engine_load, is_drained

log = logging.getLogger(__name__)

POLL_S = 0.05
HEALTH_CHECKS_AT_ONCE = 16  # apply(): /health of joining backends asked at once


class RouterError(HpcserveError):
    """The router did not start, or refused or failed a membership change."""


def default_workers(cores: int | None = None) -> int:
    """Data plane workers when serve.router_workers is not set: a quarter of the cores, 1 to 8 (the login
    node runs the controller, users' shells, a benchmark's clients). Pure."""
    return max(1, min(8, (cores if cores is not None else os.cpu_count() or 1) // 4))


@dataclass(frozen=True)
class Host:
    """The endpoint a joined deployment's model lives in: its model's settings there, and where to find the
    data plane's PID now (the host's state.json: it changes when the host's controller restarts it)."""

    spec: ModelSpec
    find_pid: Callable[[], int | None]


def dataplane_argv(host: str, port: int, api_key_file: Path | None, admin_socket: Path, policy: Routing,
                   hold_s: float, options: Sequence[str] = (), python: str = sys.executable,
                   workers: int = 1, model: str | None = None) -> list[str]:
    """The data plane's command line: no secret on it (the key is read from its 0600 file)."""
    argv = [python, "-m", MODULE, "--host", host, "--port", str(port), "--admin-socket", str(admin_socket),
            "--policy", str(policy), "--hold-s", f"{hold_s:g}"] + (["--workers", str(workers)] if workers > 1 else [])
    argv += ["--model", model] if model else []
    return argv + (["--key-file", str(api_key_file)] if api_key_file else []) + list(options)


class Router:
    """The data plane process and its admin API. One controller drives it; its calls may come from
    several threads (a round, a join thread): the desired set changes under a lock."""

    def __init__(self, host: str, port: int, api_key_file: Path | None, log_path: Path, model: str | None = None,
                 policy: Routing | str = Routing.LEAST_LOADED, admin_socket: Path | None = None, hold_s: float = 60.0,
                 options: Sequence[str] = (), python: str = sys.executable, workers: int = 1,
                 joined: Host | None = None):
        """api_key_file: a mode-0600 file with the key clients must send (and the engines expect); None
        leaves the endpoint open. model: the served name, for probe() and the data plane's own model.
        admin_socket: default beside the log, in an owner-only folder. options: more data plane flags (its
        limits; tests and benchmarks). joined: the model joins another deployment's data plane (host, port
        and admin_socket are that one's) instead of starting one."""
        self.host, self.port, self.model, self.hold_s = host, port, model, hold_s
        self.joined = joined
        self._scope = {MODEL_PARAM: joined.spec.name} if joined is not None else {}
        self.policy = Routing(policy)
        self.api_key_file = Path(api_key_file) if api_key_file else None
        self.log_path = Path(log_path)
        self.admin_socket = Path(admin_socket) if admin_socket else unix_socket_path(self.log_path.parent / "router"
                                                                                      / "admin.sock")
        self.options, self.python, self.workers = list(options), python, workers
        self.pid: int | None = None
        self._process: psutil.Popen | None = None
        self._key: str | None = None
        self._desired: dict[str, BackendSpec] = {}  # the controller's list, in join order
        self._lock = threading.RLock()
        self._client = httpx.Client(timeout=httpx.Timeout(10.0, connect=2.0), trust_env=False)
        self._admin = httpx.Client(transport=httpx.HTTPTransport(uds=str(self.admin_socket)), base_url="http://router",
                                   timeout=httpx.Timeout(10.0, connect=2.0), trust_env=False)

    @property
    def url(self) -> str:
        """The endpoint's base URL; the OpenAI base URL is url + '/v1'."""
        return f"http://{url_host(self.host)}:{self.port}"

    # -------------------------------------------------------------- lifecycle

    def start(self, backends: Iterable[str] = (), timeout_s: float = 60.0) -> None:
        """Start the data plane (its own process group) with `backends` (engines that already answered a
        real completion; capacities known from earlier calls are kept), and return once it answers and
        routes to them."""
        with self._lock:
            self._desired = {url: self._desired.get(url) or BackendSpec(url) for url in _urls(backends)}
        self._key = self.api_key_file.read_text().strip() if self.api_key_file else None
        if self.joined is not None:
            self._join()
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = dataplane_argv(self.host, self.port, self.api_key_file, self.admin_socket, self.policy, self.hold_s,
                              self.options, self.python, self.workers, self.model)
        with open(self.log_path, "ab") as log:
            self._process = psutil.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        self.pid = self._process.pid
        deadline = time.monotonic() + timeout_s
        while not self._answers(self.pid):
            if self._process.poll() is not None:
                raise RouterError(f"the router exited with code {self._process.returncode} at start; "
                                  f"its log: {self.log_path}: {_tail(self.log_path)}")
            if time.monotonic() > deadline:
                self.stop()
                raise RouterError(f"the router did not answer on {self.admin_socket} within {timeout_s:.0f} s; "
                                  f"its log: {self.log_path}")
            time.sleep(POLL_S)
        self._put()

    def _join(self) -> None:
        """Our model into the host's data plane (its room made, or its settings changed), then our backends."""
        host = self.joined
        assert host is not None  # only a joined Router joins
        pid = host.find_pid()
        if pid is None or not is_router(pid, self.port) or not self._answers(pid):
            raise RouterError(f"the endpoint this deployment joins does not serve on {self.url} now (router pid "
                              f"{pid}); its admin socket: {self.admin_socket}")
        self.pid, self._process = pid, None
        self._admin_call("PUT", f"{MODELS}/{host.spec.name}", json=host.spec.to_json())
        self._put()

    def attach(self, pid: int | None) -> bool:
        """Take over a data plane that outlived its controller (same port, same admin socket): True when
        that PID is our router on this port and answers on the admin socket. It keeps serving; its
        backends become this Router's desired set (the caller then sets the set it wants). Joined: the
        host's data plane as it runs now (pid is ignored), our model's room made again if it lost it."""
        if self.joined is not None:
            pid = self.joined.find_pid()
        if pid is None or not is_router(pid, self.port) or not self._answers(pid):
            return False
        self._key = self.api_key_file.read_text().strip() if self.api_key_file else None
        self.pid, self._process = pid, None
        if self.joined is not None:
            self._admin_call("PUT", f"{MODELS}/{self.joined.spec.name}", json=self.joined.spec.to_json())
        with self._lock:
            self._desired = {b.url: b.spec for b in self.backends()}
        return True

    def alive(self) -> bool:
        """Our data plane runs (joined: the host's, the same process as when our model joined it)."""
        if self.joined is not None and self.pid is not None and self.joined.find_pid() != self.pid:
            return False  # the host restarted its data plane: our model must join the new one
        return self.pid is not None and is_router(self.pid, self.port)

    def models(self) -> Models:
        """Every model the data plane serves (GET /models)."""
        return Models.from_json(self._admin_call("GET", MODELS).json())

    def probe(self, timeout_s: float = 60.0) -> str:
        """A real completion through the endpoint (needs `model`); its text. Raises httpx errors or
        RuntimeError, like engine.client.completion_probe."""
        if not self.model:
            raise RouterError("probe() needs the served model name: Router(..., model=NAME)")
        return completion_probe(self.url, self.model, self._key, timeout_s=timeout_s)

    def ready(self) -> bool:
        """At least one backend that may take requests now."""
        try:
            return any(b.healthy for b in self.backends())
        except RouterError:
            return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the data plane; joined: take our model out of the host's and leave it serving the others."""
        if self.joined is not None:
            self.leave()
            return
        if self.pid is not None:
            stop_router(self.pid, timeout_s, self.port)
        if self._process is not None:
            try:
                self._process.wait(timeout=1)  # reap it: no zombie left behind
            except psutil.TimeoutExpired:
                pass
        self.pid, self._process = None, None

    def leave(self) -> None:
        """Our model out of the host's data plane (its running requests finish there); nothing when the
        host's data plane is gone already."""
        name = self.joined.spec.name if self.joined is not None else self.model
        if self.pid is not None and is_router(self.pid, self.port):
            try:
                self._admin_call("DELETE", f"{MODELS}/{name}")
            except RouterError as exc:
                log.warning("could not take model %s out of %s: %s", name, self.url, exc)
        self.pid, self._process = None, None

    def close(self) -> None:
        self._client.close()
        self._admin.close()

    # -------------------------------------------------------------- membership

    def backends(self) -> list[BackendState]:
        return Backends.from_json(self.backends_json()).backends

    def backends_json(self) -> dict:
        """The data plane's whole GET /backends answer as JSON (protocol.Backends: its counters and index
        sizes per backend)."""
        return self._admin_call("GET", BACKENDS).json()

    def set_backends(self, specs: Iterable[BackendSpec]) -> None:
        """The whole desired set at once (the controller's list, with each one's capacity and state)."""
        with self._lock:
            self._desired = {spec.url: spec for spec in specs}
            self._put()

    def capacities(self) -> dict[str, int]:  # each desired backend's (the requests its engine runs at once)
        with self._lock:
            return {url: spec.capacity for url, spec in self._desired.items()}

    def add(self, url: str, capacity: int | None = None) -> None:
        """Add a backend (or change its capacity). Call it only for an engine that already answered a real
        completion (engine.client.completion_probe); it must answer /health now."""
        if self.apply(add=[url], capacities={url: capacity} if capacity else None):
            raise RouterError(f"{url} does not answer /health: not added to the router")

    def apply(self, add: Iterable[str] = (), remove: Iterable[str] = (), capacities: dict[str, int] | None = None,
              kv_tokens: dict[str, int | None] | None = None) -> set[str]:
        """One round's changes as one update of the data plane: adds must answer /health (asked at once), those
        that do not are returned; removes take effect at once, no drain wait. capacities, kv_tokens: by add."""
        adds, removes, capacities = _urls(add), set(_urls(remove)), {k.rstrip("/"): v for k, v in (capacities or {}).items()}
        sizes = {k.rstrip("/"): v for k, v in (kv_tokens or {}).items()}
        with ThreadPoolExecutor(min(HEALTH_CHECKS_AT_ONCE, max(1, len(adds)))) as pool:
            refused = {url for url, ok in zip(adds, pool.map(health_ok, adds)) if not ok}
        with self._lock:
            desired = {url: spec for url, spec in self._desired.items() if url not in removes}
            for url in adds:
                if url not in refused:
                    known = desired.get(url)
                    capacity = capacities.get(url) or (known.capacity if known else DEFAULT_MAX_NUM_SEQS)
                    desired[url] = BackendSpec(url, capacity, known.saturated if known else False,
                                               sizes.get(url) or (known.kv_tokens if known else None))
            if desired != self._desired:
                self._desired = desired
                self._put()
        return refused

    def remove(self, url: str, drain_s: float = 30.0, hand_over: bool = False) -> bool:
        """Take a backend out: no new requests go there at once (hand_over: its open streams move to the
        others now); then wait up to drain_s for the requests it still runs to finish (the data plane's own
        count, then the engine's /metrics). True when it drained, False when drain_s ran out or it no longer
        answers (a dead engine has nothing left to drain). drain_s=0: no wait and no engine call; True when
        nothing runs there through the endpoint."""
        url = url.rstrip("/")
        self.apply(remove=[url])
        if hand_over:
            self.hand_over([url])
        deadline = time.monotonic() + drain_s
        while True:
            here = self.in_flight(url)
            if drain_s <= 0:
                return here == 0
            if here == 0:
                load = self.engine_load(url)
                if load is None or is_drained(load):
                    return load is not None
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S * 2)

    def in_flight(self, url: str) -> int:
        """Requests the data plane runs to url, removed or not: counted from the moment it picks the
        backend, before the engine's /metrics shows them."""
        return Backends.from_json(self.backends_json()).in_flight_to(url.rstrip("/"))

    def busy(self, url: str) -> bool:
        """Requests still run or wait there: first the data plane's own count (a request it has just sent is
        not in the engine's /metrics yet: stopping on the engine's zero alone cut one in the handover
        test), then the engine's (a dead engine has nothing left to drain)."""
        try:
            if self.in_flight(url) > 0:
                return True
        except RouterError:
            pass  # the data plane is being restarted: the engine's figures still say whether it drained
        load = self.engine_load(url)
        return load is not None and not is_drained(load)

    def hand_over(self, urls: Iterable[str]) -> list[str]:
        """These backends are drained: the data plane moves their open streams to other backends now (what
        cannot move finishes where it is). Returns those it knew."""
        urls = _urls(urls)
        if not urls:
            return []
        return HandingOver.from_json(self._admin_call("POST", HANDOVER, json=Handover(urls).to_json()).json()).urls

    def migrations(self, after: float) -> list[dict]:
        """Streams the data plane moved to another replica (or could not) since `after` (epoch seconds): the
        JSON of each protocol.Migration (Migration.from_json reads one)."""
        return self._admin_call("GET", MIGRATIONS, params={"after": repr(after)}).json().get("migrations", [])

    def set_saturated(self, urls: Iterable[str]) -> None:
        """The backends whose engine queues requests (or whose KV cache is full) now: the data plane skips
        them while another has room. Sent only when something changed."""
        saturated = set(_urls(urls))
        with self._lock:
            desired = {url: replace(spec, saturated=url in saturated) for url, spec in self._desired.items()}
            if desired != self._desired:
                self._desired = desired
                self._put()

    def desired(self) -> list[BackendSpec]:
        with self._lock:
            return list(self._desired.values())

    def engine_load(self, url: str, timeout_s: float = 2.0) -> EngineLoad | None:
        """An engine's load from its /metrics; None when it does not answer."""
        try:
            response = self._client.get(f"{url.rstrip('/')}/metrics", headers=bearer(self._key), timeout=timeout_s)
            return engine_load(response.text) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def metrics(self) -> str:
        """The data plane's own Prometheus metrics (requests by code, latency, in flight per backend, holds,
        retries)."""
        return self._admin_call("GET", METRICS).text

    # -------------------------------------------------------------- helpers

    def set_waking(self, waking: Waking) -> None:
        """The model's wake as the controller sees it: the data plane holds, comments and refuses by it."""
        self._admin_call("PUT", WAKING, json=waking.to_json())

    def wakes(self, after: int = -1, wait_s: float = 0.0) -> Wakes:
        """Requests that found the sleeping model without a replica: at once when more than `after` did, else
        when one does or after wait_s (the data plane's long poll)."""
        try:
            response = self._admin.get(WAKING, params={**self._scope, "after": after, "wait_s": wait_s},
                                       timeout=httpx.Timeout(wait_s + 10.0, connect=2.0))
        except httpx.HTTPError as exc:
            raise RouterError(f"the router's admin socket {self.admin_socket} did not answer GET {WAKING}: "
                              f"{exc}") from exc
        if response.status_code >= 400:
            raise RouterError(f"the router refused GET {WAKING}: HTTP {response.status_code} {response.text[:200]}")
        return Wakes.from_json(response.json())

    def _put(self) -> None:
        with self._lock:
            self._admin_call("PUT", BACKENDS, json=DesiredBackends(list(self._desired.values())).to_json())

    def _admin_call(self, method: str, path: str, params: dict | None = None, **kwargs) -> httpx.Response:
        """params: the query, besides the model scope (httpx replaces a query written into the path by
        params, even empty ones: GET /migrations?after=T lost its T and answered every migration each round)."""
        try:
            response = self._admin.request(method, path, params={**self._scope, **(params or {})}, **kwargs)
        except httpx.HTTPError as exc:
            raise RouterError(f"the router's admin socket {self.admin_socket} did not answer {method} {path}: "
                              f"{exc}") from exc
        if response.status_code >= 400:
            raise RouterError(f"the router refused {method} {path}: HTTP {response.status_code} {response.text[:200]}")
        return response

    def _answers(self, pid: int) -> bool:
        """The process behind the admin socket is `pid` (not a stale one an earlier run left)."""
        try:
            return Health.from_json(self._admin.get(HEALTH, timeout=1.0).json()).pid == pid
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False


def stop_router(pid: int, timeout_s: float = 10.0, port: int | None = None) -> bool:
    """Stop a router by its recorded PID (another process may do it, e.g. `hpcserve down`): SIGTERM to
    its process group, SIGKILL after timeout_s. Does nothing when that PID is no router of ours (gone,
    reused by another program, or, given a port, another endpoint's router). True when a router was stopped."""
    if not is_router(pid, port):
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


def router_serving(pid: int | None, url: str, timeout_s: float = 2.0) -> bool:
    """What `status` checks without the controller: the recorded PID is our data plane on the URL's port,
    and it answers HTTP there (any answer: its key check refuses a caller without the key)."""
    if pid is None or not is_router(pid, httpx.URL(url).port):
        return False
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s, trust_env=False)
        return True
    except httpx.HTTPError:
        return False


def is_router(pid: int, port: int | None = None) -> bool:
    """The PID is one of our data planes (its module on the command line, or its process title), and,
    given a port, the one on that port (both name it: `--port P`)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        words = " ".join(process.cmdline()).split()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    ours = MODULE in words or (bool(words) and words[0] == PROCESS_TITLE)
    if not ours or port is None:
        return ours
    return any(word == "--port" and index + 1 < len(words) and words[index + 1] == str(port)
               for index, word in enumerate(words))


def _urls(urls: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(url.rstrip("/") for url in urls))


def _tail(path: Path, chars: int = 400) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return "(no log)"
