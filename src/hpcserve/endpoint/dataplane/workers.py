"""The data plane as several worker processes on one port (serve.router_workers > 1): one Python process
is one core, and a busy endpoint needs more than one.

    supervise(settings, key, client_socks, admin_sock)   # forks the workers, serves the admin socket

Each worker is a whole data plane (dataplane.serve) on its own SO_REUSEPORT socket of the port; the kernel
spreads new connections over them. They are forked from this process before any event loop runs, so they
share its hash seed and name prompt blocks alike (prefix_index), and each tells the others, over a pair of
Unix datagram sockets made here, which prompts (text blocks and token ids) it sent to which backend: every
worker routes with what all of them sent, and follows every engine's KV events itself (kv_feed). Each
worker reads what its siblings told it right before every choice (Peers.choosing), not only when its event
loop comes round: in a burst the loop is busy routing its own share, and on the GPU its siblings' news came
60-120 ms late, after repeats of their new prefixes had gone to the other replica. A message lost under
load (a full socket buffer) costs a little affinity, never a request.

The supervisor keeps the admin socket: PUT /backends goes to every worker's own socket (in the same
owner-only folder); GET /backends and /metrics are the workers' answers merged (in-flight counts and
counters summed). Stopping: SIGTERM reaches the whole process group (control.plane_client.stop_router) or only this
process, which passes it on, waits for the workers (their grace), and kills what is left. A worker that
dies is reported and the others serve on; each worker also dies with its supervisor (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import json
import logging
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import aiohttp
from aiohttp import web

from hpcserve.core.net import remove_unix_socket
from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane.metrics import Collector, Stats, merged_backends
from hpcserve.endpoint.dataplane.routing.table import Affinity, Backend, RoutingTable, record
from hpcserve.endpoint.dataplane.server import bind_admin_socket, metrics_response, owner_only
from hpcserve.endpoint.protocol import (
    BACKENDS,
    HANDOVER,
    HEALTH,
    METRICS,
    MIGRATIONS,
    MODEL_PARAM,
    MODELS,
    PROCESS_TITLE,
    STATS,
    WAKE_POLL_MAX_S,
    WAKING,
    DesiredBackends,
    HandingOver,
    Health,
    Migrations,
    Wakes,
)

PR_SET_PDEATHSIG = 1
DATAGRAM_BYTES = 1 << 18  # one message: a URL, up to MAX_BLOCKS 8-byte hashes and MAX_TOKENS token ids
MAX_TOKENS = 16384  # of a prompt's token ids, what siblings hear (routing looks at the leading part)
COUNTS = struct.Struct("=II")  # text blocks, token ids
WORKER_CALL_S = 10.0
WORKER_START_S = 30.0
REAP_S = 0.5
WAKE_POLL_S = 0.05  # GET /waking's long poll asks the workers this often

log = logging.getLogger(__name__)


class Peers:
    """One worker's datagram sockets to each other worker: tell() what it routed, listen() to theirs."""

    def __init__(self, sockets: list[socket.socket]):
        self.sockets = sockets
        self.dropped = 0
        self.pool_of: Callable[[str], RoutingTable | None] | None = None  # listen() sets it
        for sock in sockets:
            sock.setblocking(False)

    def tell(self, url: str, affinity: Affinity) -> None:
        """What was sent to url: the prompt's text blocks and its token ids (the leading MAX_TOKENS)."""
        tokens = (affinity.tokens or [])[:MAX_TOKENS]
        message = (url.encode() + b"\n" + COUNTS.pack(len(affinity.blocks), len(tokens))
                   + array.array("q", affinity.blocks).tobytes() + array.array("q", tokens).tobytes())
        for sock in self.sockets:
            try:
                sock.send(message)
            except (BlockingIOError, ConnectionRefusedError, OSError):
                self.dropped += 1  # a busy or gone sibling: it routes with a little less knowledge

    def listen(self, loop: asyncio.AbstractEventLoop, pool_of: Callable[[str], RoutingTable | None]) -> None:
        """pool_of: the pool (of the model's room) that holds a backend URL, or None."""
        self.pool_of = pool_of
        for sock in self.sockets:
            loop.add_reader(sock.fileno(), self.heard, sock, pool_of)

    def choosing(self, choose: Callable[..., Backend | None]) -> Callable[..., Backend | None]:
        """choose (routing.choose or the routing log's), knowing everything the siblings told so far, and
        telling them where the prompt went."""

        def choose_with_siblings(pool: RoutingTable, policy: Routing, affinity: Affinity | None, now: float,
                                 tried: tuple[Backend, ...] = ()) -> Backend | None:
            pool_of = self.pool_of or (lambda url: pool if url in pool.by_url else None)
            for sock in self.sockets:
                self.heard(sock, pool_of)
            backend = choose(pool, policy, affinity, now, tried)
            if backend is not None and affinity is not None and affinity.has_prompt:
                self.tell(backend.url, affinity)
            return backend

        return choose_with_siblings

    @staticmethod
    def heard(sock: socket.socket, pool_of: Callable[[str], RoutingTable | None]) -> None:
        while True:
            try:
                message = sock.recv(DATAGRAM_BYTES)
            except (BlockingIOError, OSError):
                return
            head, _, raw = message.partition(b"\n")
            url = head.decode(errors="replace")
            pool = pool_of(url)
            if pool is not None and len(raw) >= COUNTS.size:  # a backend this worker knows (a PUT apart at most)
                texts, tokens = COUNTS.unpack_from(raw)
                numbers = array.array("q")
                numbers.frombytes(raw[COUNTS.size:COUNTS.size + 8 * (texts + tokens)])
                values = numbers.tolist()
                record(pool, url, Affinity(None, values[:texts], values[texts:] or None), time.monotonic())


def worker_socket(admin_socket: Path, index: int) -> Path:
    """A worker's own admin socket, beside the supervisor's in its owner-only folder."""
    return admin_socket.with_name(f"{admin_socket.name}.w{index}")


def peer_links(count: int) -> list[list[socket.socket]]:
    """For each worker, one end of a datagram socket pair to every other worker."""
    ends: list[list[socket.socket]] = [[] for _ in range(count)]
    for a in range(count):
        for b in range(a + 1, count):
            left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            for sock in (left, right):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * DATAGRAM_BYTES)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * DATAGRAM_BYTES)
            ends[a].append(left)
            ends[b].append(right)
    return ends


def die_with_parent() -> None:
    """The kernel sends this worker SIGTERM when its supervisor dies (kill -9 of the supervisor alone)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the process group's SIGTERM (control.plane_client.stop_router) still reaches the workers


def supervise(settings, key: str | None, client_socks: list[socket.socket], admin_sock: socket.socket,
              serve) -> int:
    """Fork settings.workers workers, each running serve (dataplane.serve) on its socket; serve the admin
    socket for them until SIGTERM; return once they stopped."""
    paths = [worker_socket(settings.admin_socket, i) for i in range(settings.workers)]
    worker_socks = [bind_admin_socket(path) for path in paths]
    links = peer_links(settings.workers)
    pids = []
    sys.stdout.flush()
    sys.stderr.flush()  # nothing buffered here is written again by each worker
    for index in range(settings.workers):
        pid = os.fork()
        if pid == 0:  # the worker: only its own sockets stay open
            code = 0
            try:
                die_with_parent()
                for other, sock in enumerate(client_socks + worker_socks):
                    if other not in (index, settings.workers + index):
                        sock.close()
                admin_sock.close()
                for other, ends in enumerate(links):
                    if other != index:
                        for end in ends:
                            end.close()
                import setproctitle
                import uvloop

                setproctitle.setproctitle(f"{PROCESS_TITLE}-worker {index} --port {settings.port}")
                uvloop.run(serve(settings, key, client_socks[index], worker_socks[index], paths[index],
                                 Peers(links[index])))
            except BaseException:  # a worker never returns into the supervisor's code
                log.exception("worker %d failed", index)
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    for sock in client_socks + worker_socks:
        sock.close()
    for ends in links:
        for end in ends:
            end.close()
    import uvloop

    uvloop.run(Supervisor(settings, paths, pids).run(admin_sock))
    return 0


class Supervisor:
    """The admin socket in front of the workers, and their reaper."""

    def __init__(self, settings, paths: list[Path], pids: list[int]):
        self.settings, self.paths = settings, paths
        self.alive = dict(zip(pids, paths))
        self.sessions: list[aiohttp.ClientSession] = []

    async def run(self, admin_sock: socket.socket) -> None:
        self.sessions = [aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(path)),
                                               timeout=aiohttp.ClientTimeout(total=WORKER_CALL_S)) for path in self.paths]
        app = web.Application(middlewares=[owner_only], client_max_size=16 * 2**20)
        app.add_routes([web.get(BACKENDS, self.get_backends), web.put(BACKENDS, self.put_backends),
                        web.post(HANDOVER, self.post_handover), web.get(MIGRATIONS, self.get_migrations),
                        web.get(METRICS, self.get_metrics), web.get(HEALTH, self.get_health),
                        web.get(MODELS, self.get_models), web.put(MODELS + "/{name}", self.change_model),
                        web.delete(MODELS + "/{name}", self.change_model), web.put(WAKING, self.put_waking),
                        web.get(WAKING, self.get_waking)])
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await self.workers_listening()  # a PUT before that would find a worker's socket not yet listening
        await web.SockSite(runner, admin_sock).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        settings = self.settings
        log.info("serving on %s:%s with %d workers (pids %s), policy %s, hold %g s; admin socket %s", settings.host,
                 settings.port, settings.workers, " ".join(map(str, self.alive)), settings.policy, settings.hold_s,
                 settings.admin_socket)
        while not stop.is_set() and self.alive:
            self.reap()
            try:
                async with asyncio.timeout(REAP_S):
                    await stop.wait()
            except TimeoutError:
                pass
        await runner.cleanup()
        for session in self.sessions:
            await session.close()
        self.stop_workers()
        remove_unix_socket(settings.admin_socket)  # after the workers' (stop_workers): its folder goes last
        log.info("stopped")

    async def workers_listening(self) -> None:
        """Until every live worker answers on its own admin socket (bounded: one that never does is left
        out of every call, as a dead one is)."""
        deadline = time.monotonic() + WORKER_START_S
        while time.monotonic() < deadline:
            self.reap()
            answers = await self.each("GET", HEALTH)
            if all(status == 200 for status, _ in answers):
                return
            await asyncio.sleep(0.05)

    def reap(self) -> None:
        for pid in list(self.alive):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self.alive.pop(pid)
                clean = os.waitstatus_to_exitcode(status) == 0  # stopped with the rest, not lost
                log.log(logging.INFO if clean else logging.WARNING, "worker %d ended (%s); %d serve on", pid,
                        describe_status(status), len(self.alive))

    def stop_workers(self) -> None:
        for pid in self.alive:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.settings.grace_s + 2.0
        while self.alive and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.05)
        for pid in list(self.alive):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for path in self.paths:
            path.unlink(missing_ok=True)

    async def each(self, method: str, path: str, body: bytes | None = None) -> list:
        """Every live worker's JSON answer (a worker that does not answer is left out)."""
        async def one(session: aiohttp.ClientSession):
            try:
                async with session.request(method, f"http://worker{path}", data=body,
                                           headers={"Content-Type": "application/json"}) as response:
                    return response.status, await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                return None, {"error": f"{type(exc).__name__}: {exc}"}

        live = [session for session, path in zip(self.sessions, self.paths) if path in self.alive.values()]
        return await asyncio.gather(*(one(session) for session in live))

    async def put_backends(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:  # refused here, whole, before any worker sees it
            DesiredBackends.from_json(json.loads(body))
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=400)
        answers = await self.each("PUT", scoped(BACKENDS, request), body)
        failed = [data for status, data in answers if status != 200]
        if failed and all(status == 404 for status, _ in answers):  # a model not served here
            return web.json_response(failed[0], status=404)
        if failed:
            return web.json_response({"error": f"{len(failed)} worker(s) refused the backends: {failed[0]}"},
                                     status=502)
        return web.json_response(merged_json([data for _, data in answers]))

    async def post_handover(self, request: web.Request) -> web.Response:
        answers = await self.each("POST", scoped(HANDOVER, request), await request.read())
        marked = sorted({url for status, data in answers if status == 200 for url in HandingOver.from_json(data).urls})
        return web.json_response(HandingOver(marked).to_json())

    async def get_migrations(self, request: web.Request) -> web.Response:
        answers = await self.each("GET", scoped(MIGRATIONS, request))
        merged = sorted((m for status, data in answers if status == 200 for m in Migrations.from_json(data).migrations),
                        key=lambda m: m.time)
        return web.json_response(Migrations(merged).to_json())

    async def get_backends(self, request: web.Request) -> web.Response:
        answers = await self.each("GET", scoped(BACKENDS, request))
        if answers and all(status == 404 for status, _ in answers):
            return web.json_response(answers[0][1], status=404)
        return web.json_response(merged_json([data for status, data in answers if status == 200]))

    async def get_models(self, _request: web.Request) -> web.Response:
        """The first live worker's: every worker is told of each model (change_model)."""
        for status, data in await self.each("GET", MODELS):
            if status == 200:
                return web.json_response(data)
        return web.json_response({"error": "no worker answered"}, status=502)

    async def change_model(self, request: web.Request) -> web.Response:
        """PUT or DELETE /models/NAME, to every worker: each routes that model's requests itself."""
        answers = await self.each(request.method, request.path_qs, await request.read())
        failed = [(status, data) for status, data in answers if status != 200]
        if failed:
            status, data = failed[0]
            return web.json_response(data, status=status if status in (400, 409) else 502)
        return web.json_response(answers[0][1] if answers else {"models": []})

    async def put_waking(self, request: web.Request) -> web.Response:
        """To every worker: each holds its own requests for the model."""
        answers = await self.each("PUT", scoped(WAKING, request), await request.read())
        failed = [(status, data) for status, data in answers if status != 200]
        if failed:
            status, data = failed[0]
            return web.json_response(data, status=status if status in (400, 404) else 502)
        return web.json_response(answers[0][1] if answers else {})

    async def get_waking(self, request: web.Request) -> web.Response:
        """The workers' counts summed; a long poll here asks them every WAKE_POLL_S until more asked."""
        model = request.query.get(MODEL_PARAM)
        path = WAKING + (f"?{MODEL_PARAM}={quote(model)}" if model is not None else "")
        try:
            after = int(request.query.get("after", "-1"))
            wait_s = min(float(request.query.get("wait_s", "0")), WAKE_POLL_MAX_S)
        except ValueError:
            return web.json_response({"error": "after must be a whole number, wait_s a number"}, status=400)
        deadline = time.monotonic() + wait_s
        while True:
            answers = [data for status, data in await self.each("GET", path) if status == 200]
            wakes = Wakes(sum(Wakes.from_json(a).asked for a in answers), sum(Wakes.from_json(a).held for a in answers))
            if wakes.asked > after or time.monotonic() >= deadline:
                return web.json_response(wakes.to_json())
            await asyncio.sleep(WAKE_POLL_S)

    async def get_metrics(self, _request: web.Request) -> web.Response:
        parts = [data for status, data in await self.each("GET", STATS) if status == 200]
        stats = Stats.merged([part["stats"] for part in parts])
        backends = merged_backends([part["backends"]["backends"] for part in parts])
        return metrics_response(Collector(stats, backends, workers=len(parts)))

    async def get_health(self, _request: web.Request) -> web.Response:
        return web.json_response(Health(os.getpid(), self.settings.port, list(self.alive)).to_json())


def scoped(path: str, request: web.Request) -> str:
    """path with the request's query (?model=NAME, ?after=T): the workers answer for the same model."""
    return f"{path}?{request.query_string}" if request.query_string else path


def merged_json(parts: list[dict]) -> dict:
    """One GET /backends answer from the workers' (held, waiting and in-flight counts summed). Pure."""
    if not parts:
        return {"backends": [], "retired": [], "held": 0, "workers": 0}
    first = parts[0]
    return {**first, "held": sum(p.get("held", 0) for p in parts), "waiting": sum(p.get("waiting", 0) for p in parts),
            "workers": len(parts),
            "backends": merged_backends([p.get("backends", []) for p in parts]),
            "retired": merged_backends([p.get("retired", []) for p in parts])}


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.WEXITSTATUS(status)}"
