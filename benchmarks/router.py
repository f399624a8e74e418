"""The data plane's cost: the same load straight to the backends, through hpcserve's data plane, and
through vllm-router (the data plane it replaced), side by side in one run (alternating blocks, the order
rotated every block so drift of a shared machine hits all modes).

    flock /tmp/hpcserve-heavy.lock .venv/bin/python benchmarks/router.py stub [--blocks 6] [--json F]
    flock /tmp/hpcserve-heavy.lock .venv/bin/python benchmarks/router.py vllm [--blocks 4 --requests 24]

`stub`: two OpenAI stand-ins (hpcserve.testing.standin, 16 tokens, no delay) on loopback, so that a
fraction of a millisecond is not hidden by an engine's noise. Phases: streamed requests at concurrency 1
and 16 (added p50/p99 TTFT and e2e over direct), then the ceiling (a closed loop of 64 clients, requests
per second, non-streamed and streamed), each with the router's CPU per request. The client is a small
aiohttp loop in this process (TTFT = the first body bytes after the request went out, e2e = the end of
the response; no JSON parsing, so it takes as little CPU from the servers as it can).
`vllm`: two real vLLM engines (the builtin tiny model, one core each); throughput through each router
against direct at concurrency 1 and 8, with hpcserve's load generator (tokens counted from usage).
Direct traffic goes round-robin over the backends. Every loop is bounded in requests and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import psutil
from vllm_router_launch import VllmRouter

from hpcserve.benchmark.loadgen import LoadShape, RequestInput, run_load
from hpcserve.benchmark.stats import percentile
from hpcserve.core.net import free_loopback_port as free_port
from hpcserve.core.statuses import Routing
from hpcserve.endpoint.control.plane_client import Router
from hpcserve.engine.client import Endpoint, completion_probe
from hpcserve.testing.harness import spawn, stop, wait_until

KEY = "router-bench-key"
MODES = ("direct", "dataplane", "vllm-router")
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
PROMPT = "The quick brown fox jumps over the lazy dog and keeps running through the"


@dataclass
class Target:
    name: str
    urls: list[str]
    pids: list[int]  # the router's process (CPU is counted over it and its children)


# ------------------------------------------------------------------ backends and routers

def start_stubs(directory: Path, tokens: int, extra: tuple[str, ...] = ()) -> tuple[list[subprocess.Popen], list[str]]:
    """Two stand-ins (also for tenancy_fair_share.py's pool of places); extra: more stand-in arguments."""
    procs, urls = [], []
    for name in ("a", "b"):
        port = free_port()
        argv = [sys.executable, "-m", "hpcserve.testing.standin", "--port", str(port), "--name", name,
                "--tokens", str(tokens), *extra]
        procs.append(spawn(argv, directory / f"stub-{name}.log", {"HPCSERVE_STUB_API_KEY": KEY}))
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        wait_until(lambda url=url: httpx.get(f"{url}/health", timeout=1).status_code == 200, 30, f"{url}/health")
    return procs, urls


def start_engines(directory: Path, cores: tuple[int, ...] = (0, 1), extra: tuple[str, ...] = ()
                  ) -> tuple[list[subprocess.Popen], list[str]]:
    """vLLM CPU engines of the builtin tiny model, one per core, guarded by KEY (also for the other
    benchmarks on real engines: tenancy_fair_share.py, tenancy_usage.py). extra: more vLLM arguments."""
    from hpcserve.models.tiny import tiny_model_path

    procs, urls = [], []
    tmp = directory / "t"  # vLLM's IPC sockets and its other temporary files: gone with the run's folder
    tmp.mkdir(mode=0o700, exist_ok=True)
    for core in cores:
        port = free_port()
        argv = [sys.executable, "-m", "hpcserve.engine.vllm_cli", "serve", str(tiny_model_path()),
                "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--max-model-len", "512", *extra]
        env = {"VLLM_API_KEY": KEY, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
               "TMPDIR": str(tmp)}
        procs.append(spawn(argv, directory / f"engine-{core}.log", env))
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        wait_until(lambda url=url: completion_probe(url, "tiny", KEY, timeout_s=30) is not None, 600,
                   f"a completion from {url}")
    return procs, urls


def start_routers(directory: Path, urls: list[str], policy: Routing) -> tuple[Router, VllmRouter]:
    key_path = directory / "api_key"
    key_path.write_text(KEY)
    key_path.chmod(0o600)
    ours = Router("127.0.0.1", free_port(), key_path, directory / "dataplane.log", policy=policy,
                  admin_socket=directory / "dp" / "admin.sock")
    ours.start(urls)
    theirs = VllmRouter(free_port(), key_path, directory / "vllm-router.log")
    theirs.start(urls)
    return ours, theirs


# ------------------------------------------------------------------ the light client (stub phases)

def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            process = psutil.Process(pid)
            for each in [process, *process.children(recursive=True)]:
                times = each.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def body(stream: bool, tokens: int, index: int) -> bytes:
    return json.dumps({"model": "stub", "prompt": f"{PROMPT} {index}", "max_tokens": tokens,
                       "stream": stream}).encode()


async def one(session: aiohttp.ClientSession, url: str, data: bytes, stream: bool, record: dict) -> None:
    sent = time.perf_counter()
    try:
        async with session.post(url, data=data, headers=HEADERS) as response:
            first = None
            async for _chunk in response.content.iter_any():
                first = first or time.perf_counter()
            end = time.perf_counter()
            if response.status != 200:
                record["failed"] += 1
                return
    except Exception:  # noqa: BLE001 - a failure is data
        record["failed"] += 1
        return
    record["ttft"].append(((first or end) - sent) * 1000)
    record["e2e"].append((end - sent) * 1000)


async def closed_loop(target: Target, clients: int, stream: bool, tokens: int, requests: int, seconds: float) -> dict:
    """`clients` loops sending one request after the other until `requests` were sent or `seconds` passed."""
    record = {"ttft": [], "e2e": [], "failed": 0}
    urls = [f"{u}/v1/completions" for u in target.urls]
    counter = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=clients, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False,
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        cpu0, started = cpu_seconds(target.pids), time.perf_counter()

        async def worker() -> None:
            for index in counter:
                if loop.time() > deadline:
                    return
                await one(session, urls[index % len(urls)], body(stream, tokens, index), stream, record)

        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - started
        record.update(wall_s=wall, cpu_s=cpu_seconds(target.pids) - cpu0)
    return record


def merge(blocks: list[dict]) -> dict:
    ttft = [x for b in blocks for x in b["ttft"]]
    e2e = [x for b in blocks for x in b["e2e"]]
    wall = sum(b["wall_s"] for b in blocks)
    done = len(e2e)
    return {"requests": done, "failed": sum(b["failed"] for b in blocks),
            "p50_ttft_ms": percentile(ttft, 50), "p99_ttft_ms": percentile(ttft, 99),
            "p50_e2e_ms": percentile(e2e, 50), "p99_e2e_ms": percentile(e2e, 99),
            "req_per_s": done / wall if wall else None,
            "block_req_per_s": [round(len(b["e2e"]) / b["wall_s"], 1) for b in blocks],
            "router_cpu_ms_per_request": 1000 * sum(b["cpu_s"] for b in blocks) / done if done else None}


async def alternate(targets: dict[str, Target], blocks: int, run_block) -> dict:
    for name in MODES:  # warm connections and caches, unmeasured
        await run_block(targets[name], warm=True)
    runs = {name: [] for name in MODES}
    for index in range(blocks):
        order = MODES[index % len(MODES):] + MODES[:index % len(MODES)]
        for name in order[::-1] if index % 2 else order:
            runs[name].append(await run_block(targets[name], warm=False))
    return {name: merge(r) for name, r in runs.items()}


async def stub_phases(targets: dict[str, Target], args: argparse.Namespace) -> dict:
    results = {}
    for concurrency in (1, 16):
        async def latency(target, warm, concurrency=concurrency):
            n = 4 * concurrency if warm else args.requests * (2 if concurrency > 1 else 1)
            return await closed_loop(target, concurrency, True, args.output_len, n, 120)

        point = await alternate(targets, args.blocks, latency)
        for name in MODES:
            for figure in ("p50_ttft_ms", "p99_ttft_ms", "p50_e2e_ms", "p99_e2e_ms"):
                point[name][f"added_{figure}"] = point[name][figure] - point["direct"][figure]
        results[f"latency_c{concurrency}"] = point
        show(f"streamed, {args.output_len} tokens, concurrency {concurrency}", point,
             ["requests", "failed", "p50_ttft_ms", "added_p50_ttft_ms", "p99_ttft_ms", "added_p99_ttft_ms",
              "p50_e2e_ms", "added_p50_e2e_ms", "p99_e2e_ms", "added_p99_e2e_ms", "req_per_s",
              "router_cpu_ms_per_request"])
    for stream in (False, True):
        async def ceiling(target, warm, stream=stream):
            return await closed_loop(target, 64, stream, args.output_len, 1_000_000, 1.0 if warm else args.block_s)

        point = await alternate(targets, max(2, args.blocks // 2), ceiling)
        results[f"ceiling_{'streamed' if stream else 'plain'}"] = point
        show(f"ceiling: closed loop of 64 clients, {'streamed' if stream else 'non-streamed'}", point,
             ["requests", "failed", "req_per_s", "block_req_per_s", "p50_e2e_ms", "p99_e2e_ms",
              "router_cpu_ms_per_request"])
    return results


# ------------------------------------------------------------------ real engines

def vllm_block(endpoints: list[Endpoint], requests: int, concurrency: int, output_len: int) -> dict:
    inputs = [RequestInput(prompt=f"{PROMPT} {i}", output_len=output_len) for i in range(requests)]
    result = asyncio.run(run_load(endpoints, inputs, LoadShape(concurrency=concurrency), [0.0] * requests,
                                  timeout_s=600))
    good = [o for o in result.outputs if o.ok]
    return {"e2e_ms": [o.e2e_s * 1000 for o in good], "ttft_ms": [o.ttft_s * 1000 for o in good],
            "failed": len(result.outputs) - len(good), "tokens": sum(o.output_tokens for o in good),
            "duration_s": result.duration_s}


def vllm_phases(targets: dict[str, Target], args: argparse.Namespace) -> dict:
    results = {}
    for concurrency in (1, 8):
        endpoints = {name: [Endpoint(url, "tiny", KEY) for url in t.urls] for name, t in targets.items()}
        runs = {name: [] for name in MODES}
        for name in MODES:
            vllm_block(endpoints[name], max(4, concurrency), concurrency, args.output_len)  # warm-up
        for index in range(args.blocks):
            order = MODES[index % len(MODES):] + MODES[:index % len(MODES)]
            for name in order[::-1] if index % 2 else order:
                runs[name].append(vllm_block(endpoints[name], args.requests, concurrency, args.output_len))
        point = {}
        for name, blocks in runs.items():
            duration = sum(b["duration_s"] for b in blocks)
            point[name] = {"requests": sum(len(b["e2e_ms"]) for b in blocks), "failed": sum(b["failed"] for b in blocks),
                           "tokens_per_s": sum(b["tokens"] for b in blocks) / duration,
                           "p50_ttft_ms": percentile([x for b in blocks for x in b["ttft_ms"]], 50),
                           "p50_e2e_ms": percentile([x for b in blocks for x in b["e2e_ms"]], 50),
                           "block_tokens_per_s": [round(b["tokens"] / b["duration_s"], 1) for b in blocks]}
        for name in MODES:
            point[name]["throughput_ratio"] = point[name]["tokens_per_s"] / point["direct"]["tokens_per_s"]
        results[f"vllm_c{concurrency}"] = point
        show(f"two vLLM engines (tiny model, CPU), concurrency {concurrency}", point,
             ["requests", "failed", "tokens_per_s", "throughput_ratio", "p50_ttft_ms", "p50_e2e_ms",
              "block_tokens_per_s"])
    return results


def show(title: str, point: dict, columns: list[str]) -> None:
    print(f"\n## {title}\n| mode | " + " | ".join(columns) + " |")
    for name, figures in point.items():
        cells = [f"{figures.get(c):.2f}" if isinstance(figures.get(c), float) else str(figures.get(c)) for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend", choices=["stub", "vllm"])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--requests", type=int, default=200, help="requests per latency block")
    parser.add_argument("--block-s", type=float, default=4.0, help="seconds per ceiling block")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--policy", default=str(Routing.LEAST_LOADED), choices=[str(p) for p in Routing])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="router-bench-"))
    procs, urls = start_stubs(directory, args.output_len) if args.backend == "stub" else start_engines(directory)
    ours = theirs = None
    results = {"backend": args.backend, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()}",
               "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        ours, theirs = start_routers(directory, urls, Routing(args.policy))
        targets = {"direct": Target("direct", urls, []), "dataplane": Target("dataplane", [ours.url], [ours.pid]),
                   "vllm-router": Target("vllm-router", [theirs.url], [theirs.proc.pid])}
        if args.backend == "stub":
            results.update(asyncio.run(stub_phases(targets, args)))
        else:
            results.update(vllm_phases(targets, args))
    finally:
        for router in (ours, theirs):
            if router is not None:
                router.stop()
        for proc in procs:
            stop(proc)
    results["load_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"\nlogs: {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
