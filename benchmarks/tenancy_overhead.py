"""What tenancy costs the data plane: users' keys, limits and the usage record on, against the same data plane
with them off, side by side in one run (alternating blocks, the order flipped every block so that drift of a
shared machine hits both).

    flock /tmp/hpcserve-heavy.lock .venv/bin/python benchmarks/tenancy_overhead.py [--blocks 6] [--block-s 8]
        [--users 100] [--clients 64] [--rate R] [--stream-rate R] [--tokens 16] [--json F]

Two stand-in engines (hpcserve.testing.standin, --tokens SSE chunks, no delay) behind two data planes of one
worker each, the same flags but one with --tenancy: a real SQLite store with --users keys (each with a
requests-per-minute, tokens-per-minute and tokens-per-day limit far above what the run sends, and the
default caps), the requests spread over the users' keys; the other with the deployment's key alone. Per
block, a closed loop of --clients requests in flight (aiohttp in this process), non-streamed then streamed, or
with --rate / --stream-rate the same clients paced to that many requests/s together: both modes then serve the
same load, so that their CPU per request is compared at one load (in a closed loop the faster mode batches more
requests per turn of its event loop, and the ratio moved by 0.17 between runs of the same code):
- the data plane's CPU per request (its process's user + system time over the block / requests answered), and
  its event loop's alone (the main thread's; the rest is the tenancy thread's: keys, counts, usage writes);
- stream chunks per second received by the clients.
Prints one line per figure and mode, the ratios on / off, and the whole result as JSON (also --json); the
usage rows written during the run are counted against the requests answered (each once).
Both data planes run on the last core this process may use (they take turns), everything else on the others.
Processes are started in sessions of their own and stopped by their PIDs; the temporary folder goes at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import aiohttp
import psutil
from tenancy_bench import finish, workspace

from hpcserve.core.net import free_loopback_port as free_port
from hpcserve.endpoint.control.plane_client import Router
from hpcserve.tenancy.keyring import add_key
from hpcserve.tenancy.records import Limits
from hpcserve.tenancy.store import open_store
from hpcserve.testing.harness import spawn

KEY = "tenancy-bench-key"
MODES = ("off", "on")
PROMPT = "The quick brown fox jumps over the lazy dog and keeps running through the"


def cpu_seconds(pid: int) -> tuple[float, float]:
    """The data plane's CPU seconds (its process and children), and those of its main thread (the event loop)."""
    process = psutil.Process(pid)
    total = sum(t.user + t.system for t in (p.cpu_times() for p in [process, *process.children(recursive=True)]))
    main = next((t.user_time + t.system_time for t in process.threads() if t.id == pid), 0.0)
    return total, main


async def block(url: str, pid: int, keys: list[str], clients: int, stream: bool, tokens: int, seconds: float,
                rate: float = 0.0) -> dict:
    """A closed loop for `seconds` (rate > 0: each client paced so that all send `rate` requests/s together, or
    as fast as their answers come if slower): requests answered, failures, chunks received, the data plane's CPU."""
    record = {"requests": 0, "failed": 0, "chunks": 0}
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=clients, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False,
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        deadline = loop.time() + seconds
        cpu0, started = cpu_seconds(pid), time.perf_counter()

        async def worker(index: int) -> None:
            count = 0
            period = clients / rate if rate > 0 else 0.0
            due = loop.time() + period * index / clients  # staggered: the clients' requests spread evenly
            while loop.time() < deadline:
                if period:
                    if due > loop.time():
                        await asyncio.sleep(due - loop.time())
                    due += period
                count += 1
                key = keys[(index * 7919 + count) % len(keys)]
                body = {"model": "stub", "prompt": f"{PROMPT} {index} {count}", "max_tokens": tokens,
                        "stream": stream}
                try:
                    async with session.post(f"{url}/v1/completions", json=body,
                                            headers={"Authorization": f"Bearer {key}"}) as answer:
                        async for chunk in answer.content.iter_any():
                            record["chunks"] += chunk.count(b"data: {") if stream else 0
                        ok = answer.status == 200
                except aiohttp.ClientError:
                    ok = False
                record["requests" if ok else "failed"] += 1

        await asyncio.gather(*(worker(i) for i in range(clients)))
        cpu1 = cpu_seconds(pid)
        record.update(wall_s=time.perf_counter() - started, cpu_s=cpu1[0] - cpu0[0], loop_cpu_s=cpu1[1] - cpu0[1])
    return record


def pin(pid: int, cores: list[int]) -> None:
    """Both data planes share one core of their own (they take turns, block by block), the clients and
    stand-ins the others: otherwise each mode's process lands where the scheduler puts it, and a core it shares
    with the busy client makes every operation in it slower, which alternating blocks cannot even out."""
    if cores:
        psutil.Process(pid).cpu_affinity(cores)


def summary(blocks: list[dict], stream: bool) -> dict:
    requests, wall = sum(b["requests"] for b in blocks), sum(b["wall_s"] for b in blocks)
    figures = {"requests": requests, "failed": sum(b["failed"] for b in blocks),
               "cpu_ms_per_request": round(1000 * sum(b["cpu_s"] for b in blocks) / max(requests, 1), 4),
               "loop_cpu_ms_per_request": round(1000 * sum(b["loop_cpu_s"] for b in blocks) / max(requests, 1), 4),
               "req_per_s": round(requests / wall, 1)}
    if stream:
        figures["chunks_per_s"] = round(sum(b["chunks"] for b in blocks) / wall, 1)
    return figures


async def measure(targets: dict[str, tuple[str, int, list[str]]], args: argparse.Namespace) -> dict:
    results: dict = {"warm_up_requests_on": 0}

    def rate(stream: bool) -> float:
        return args.stream_rate if stream else args.rate

    for stream in (False, True):
        for mode in MODES:  # warm connections and caches, unmeasured (their usage rows are counted)
            warm = await block(*targets[mode], args.clients, stream, args.tokens, 1.0, rate(stream))
            if mode == "on":
                results["warm_up_requests_on"] += warm["requests"] + warm["failed"]
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for index in range(args.blocks):
            for mode in MODES[::-1] if index % 2 else MODES:
                runs[mode].append(await block(*targets[mode], args.clients, stream, args.tokens, args.block_s,
                                              rate(stream)))
        point = {mode: summary(runs[mode], stream) for mode in MODES}
        point["ratio_cpu_per_request"] = round(point["on"]["cpu_ms_per_request"] / point["off"]["cpu_ms_per_request"], 3)
        if stream:
            point["ratio_chunks_per_s"] = round(point["on"]["chunks_per_s"] / point["off"]["chunks_per_s"], 3)
        results["streamed" if stream else "plain"] = point
        print(json.dumps({"streamed" if stream else "plain": point}), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--block-s", type=float, default=8.0)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rate", type=float, default=0.0,
                        help="whole answers: requests/s of all clients together, both modes alike (0: closed loop)")
    parser.add_argument("--stream-rate", type=float, default=0.0, help="streams: the same")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--usage-flush-s", type=float, default=1.0,
                        help="the data plane's usage_flush_s (how often its rows are written)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    with workspace("hpcserve-tenancy-bench-") as here:
        key_file = here.key_file(KEY)
        urls = []
        for name in ("a", "b"):
            port = free_port()
            here.processes.append(spawn([sys.executable, "-m", "hpcserve.testing.standin", "--port", str(port),
                                         "--name", name, "--token-delay-ms", "0", "--tokens", str(args.tokens)],
                                        here.folder / f"stub-{name}.log", env={"HPCSERVE_STUB_API_KEY": KEY}))
            urls.append(f"http://127.0.0.1:{port}")
        database = here.folder / "tenancy.sqlite"
        store = open_store(database)
        limits = Limits(requests_per_minute=10**7, tokens_per_minute=10**9, tokens_per_day=10**12)
        keys = [add_key(store, f"user{i:03d}", project=f"project{i % 10}", limits=limits)[0] for i in range(args.users)]
        store.close()
        settings = here.tenancy(database, flush_s=args.usage_flush_s)
        targets = {}
        for mode in MODES:
            options = ["--tenancy", str(settings)] if mode == "on" else []
            router = Router("127.0.0.1", free_port(), key_file, here.folder / f"plane-{mode}.log", model="stub",
                            admin_socket=here.folder / mode / "admin.sock", options=options)
            here.routers.append(router)
            router.start(urls)
            pin(router.pid, [cores[-1]])
            targets[mode] = (router.url, router.pid, keys if mode == "on" else [KEY])
        for process in here.processes:
            pin(process.pid, cores[:-1])
        pin(os.getpid(), cores[:-1])
        started = time.time()
        results = asyncio.run(measure(targets, args))
        time.sleep(args.usage_flush_s + 1.5)  # the last usage rows written (usage_flush_s + the poll)
        store = open_store(database)
        rows = len(store.rows(started - 5))
        store.close()
        answered_on = sum(results[k]["on"]["requests"] + results[k]["on"]["failed"] for k in ("plain", "streamed"))
        results["usage_rows"] = {"rows": rows, "requests_on_with_warm_ups": answered_on + results.pop("warm_up_requests_on")}
        finish(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
