"""Stream chunks per second through hpcserve's data plane with 1 and 2 worker processes, over CPU stand-ins.

    PYTHONPATH=src .venv/bin/python benchmarks/dataplane_workers.py [--workers 1,2] [--standins 6] [--clients 4]
        [--concurrency 256] [--tokens 256] [--seconds 10] [--warmup 2] [--policy prefix] [--budget S]
        [--json OUT.json] [--logdir DIR]

Stand-ins (hpcserve.testing.standin, one process each, no token delay: each answer is --tokens SSE chunks as
fast as they go) behind `python -m hpcserve.endpoint.dataplane --workers W` (the flag is passed only when
W > 1; a data plane whose --help has no --workers gets an error for W > 1, recorded, and the run goes on).
--clients processes keep --concurrency streamed completions in flight between them (aiohttp, closed loop),
each counting the SSE `data:` events it receives; chunks/s = the events received in the --seconds window
after --warmup, all clients together. Each group's CPU use in the window (data plane processes, stand-ins,
clients, in cores) says which one was the limit: the figure measures the data plane only while its
workers are the busy ones (W cores) and the others are not. The worker counts run in the order given
(1,2 by default; 1,2,2,1 alternates), a fresh data plane each. Prints one line per run, the ratio of the
best W=2 over the best W=1, and (last line) the whole result as JSON (also --json).
On a 2-core machine the stand-ins and clients share the cores with the data plane: the ratio there says
nothing about scaling; run it where there are cores to spare (the GPU device's 16, routing_device.sh workers).
Processes are started in sessions of their own and stopped by their PIDs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from hpcserve.testing.harness import ports_to_listen_on, spawn, stop


def wait_health(url: str, proc: subprocess.Popen, timeout_s: float = 30.0, uds: str | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    transport = httpx.HTTPTransport(uds=uds) if uds else None
    with httpx.Client(transport=transport, timeout=1, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def client_main(url: str, concurrency: int, tokens: int, start: float, warmup: float, seconds: float, index: int,
                out: mp.Queue) -> None:
    """One load process: `concurrency` streams kept open until the window ends; events counted in it."""
    import aiohttp

    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    counts = {"events": 0, "requests": 0, "failed": 0, "errors": []}
    t_from, t_to = start + warmup, start + warmup + seconds

    async def stream(session: aiohttp.ClientSession, i: int) -> None:
        body = {"model": "stub", "prompt": f"client {index} request {i} " * 8, "max_tokens": tokens, "stream": True}
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}")
            async for data in r.content.iter_any():
                now = time.time()
                if t_from <= now < t_to:
                    counts["events"] += data.count(b"data: {")
                if now >= t_to:
                    return
        now = time.time()
        if t_from <= now < t_to:
            counts["requests"] += 1

    async def loop(session: aiohttp.ClientSession, slot: int) -> None:
        i = slot
        while time.time() < t_to:
            try:
                await stream(session, i)
            except Exception as exc:  # noqa: BLE001 - counted
                counts["failed"] += 1
                if len(counts["errors"]) < 3:
                    counts["errors"].append(f"{type(exc).__name__}: {exc}"[:160])
                await asyncio.sleep(0.05)
            i += concurrency

    async def main() -> None:
        await asyncio.sleep(max(0.0, start - time.time()))
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None, sock_read=60)) as s:
            await asyncio.gather(*(loop(s, k) for k in range(concurrency)))

    run(main())
    out.put(counts)


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            procs = [psutil.Process(pid)]
            procs += procs[0].children(recursive=True)
        except psutil.Error:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    return total


def has_workers_flag() -> bool:
    out = subprocess.run([sys.executable, "-m", "hpcserve.endpoint.dataplane", "--help"], capture_output=True, text=True)
    return "--workers" in out.stdout


def one_run(workers: int, backends: list[str], a, logdir: Path, n: int) -> dict:
    port = ports_to_listen_on(1)[0]
    sock_dir = Path(tempfile.mkdtemp(prefix="dpw-", dir="/tmp"))
    sock = sock_dir / "admin" / "admin.sock"
    argv = [sys.executable, "-m", "hpcserve.endpoint.dataplane", "--host", "127.0.0.1", "--port", str(port),
            "--admin-socket", str(sock), "--policy", a.policy]
    if workers > 1:
        argv += ["--workers", str(workers)]
    argv += shlex.split(a.plane_args)
    plane = spawn(argv, logdir / f"dataplane_{n}_w{workers}.log")
    result = {"workers": workers, "run": n}
    try:
        wait_health("http://x/health", plane, 30, uds=str(sock))
        specs = [{"url": u, "capacity": 4096} for u in backends]
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=10, trust_env=False) as admin:
            put = admin.put("http://x/backends", json={"backends": specs})
            put.raise_for_status()
        url = f"http://127.0.0.1:{port}"
        wait_health(url + "/health", plane, 30)
        queue: mp.Queue = mp.get_context("fork").Queue()
        start = time.time() + 1.0
        per = max(1, a.concurrency // a.clients)
        clients = [mp.get_context("fork").Process(target=client_main, args=(url, per, a.tokens, start, a.warmup,
                                                                           a.seconds, k, queue)) for k in range(a.clients)]
        for c in clients:
            c.start()
        time.sleep(max(0.0, start + a.warmup - time.time()))
        groups = {"dataplane": [plane.pid], "standins": a.standin_pids, "clients": [c.pid for c in clients]}
        before = {g: cpu_seconds(p) for g, p in groups.items()}
        time.sleep(a.seconds)
        after = {g: cpu_seconds(p) for g, p in groups.items()}
        counts = [queue.get(timeout=a.seconds + 60) for _ in clients]
        for c in clients:
            c.join(timeout=30)
            if c.is_alive():
                c.kill()
        events = sum(c["events"] for c in counts)
        result.update({"chunks_s": round(events / a.seconds, 1), "events": events,
                       "requests_done": sum(c["requests"] for c in counts), "failed": sum(c["failed"] for c in counts),
                       "errors": [e for c in counts for e in c["errors"]][:3],
                       "cores": {g: round((after[g] - before[g]) / a.seconds, 2) for g in groups}})
    except Exception as exc:  # noqa: BLE001 - one failed run is reported, the others go on
        result["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        stop(plane, 15)
        shutil.rmtree(sock_dir, ignore_errors=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2", help="worker counts, in the order run (e.g. 1,2,2,1)")
    ap.add_argument("--standins", type=int, default=6)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--policy", default="prefix")
    ap.add_argument("--budget", type=float, default=0, help="seconds for everything: worker counts that would not fit are skipped")
    ap.add_argument("--plane-args", default="", help="more data plane flags for every run, e.g. '--migrations 0'")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--logdir", type=Path)
    a = ap.parse_args()
    counts = [int(w) for w in a.workers.split(",") if w]
    t_start = time.monotonic()
    logdir = a.logdir or Path(tempfile.mkdtemp(prefix="dpw-logs-"))
    logdir.mkdir(parents=True, exist_ok=True)
    flag = has_workers_flag()
    info = {"cpus": os.cpu_count(), "workers_flag": flag, "standins": a.standins, "clients": a.clients,
            "concurrency": a.concurrency, "tokens": a.tokens, "seconds": a.seconds, "policy": a.policy,
            "plane_args": a.plane_args,
            "python": sys.version.split()[0]}
    print(f"dataplane_workers: {info}", flush=True)
    ports = ports_to_listen_on(a.standins)
    standins = [spawn([sys.executable, "-m", "hpcserve.testing.standin", "--port", str(p), "--name", f"s{p}",
                       "--tokens", str(a.tokens), "--token-delay-ms", "0", "--small-metrics"], logdir / f"standin_{p}.log")
                for p in ports]
    a.standin_pids = [s.pid for s in standins]
    runs = []
    try:
        for proc, p in zip(standins, ports):
            wait_health(f"http://127.0.0.1:{p}/health", proc)
        backends = [f"http://127.0.0.1:{p}" for p in ports]
        per_run = a.warmup + a.seconds + 8
        for n, w in enumerate(counts):
            if a.budget and time.monotonic() - t_start + per_run > a.budget:
                print(f"W={w} skipped: the budget", flush=True)
                runs.append({"workers": w, "run": n, "skipped": True})
                continue
            if w > 1 and not flag:
                r = {"workers": w, "run": n, "error": "this data plane has no --workers"}
            else:
                r = one_run(w, backends, a, logdir, n)
            runs.append(r)
            print(f"W={w}: {json.dumps(r)}", flush=True)
    finally:
        for s in standins:
            stop(s, 10)
    best = {w: max((r.get("chunks_s") or 0 for r in runs if r["workers"] == w), default=0) for w in set(counts)}
    ratio = round(best[2] / best[1], 3) if best.get(1) and best.get(2) else None
    out = {**info, "runs": runs, "best_chunks_s": best, "ratio_2_over_1": ratio}
    print(f"chunks/s best by workers: {best}; 2 workers / 1 = {ratio}", flush=True)
    print(json.dumps(out), flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
