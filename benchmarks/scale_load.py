"""A light load generator for the scale benchmarks (its own process, so its CPU is its own): non-streamed
completions at a fixed rate (open loop: requests start on schedule whatever the answers do) or from a
closed loop of clients, against one URL (the endpoint) or round-robin over many (the stand-ins
directly). Bounded: it stops after --duration-s (at most 600 s) and sends at most --max-requests.

    python benchmarks/scale_load.py --url http://127.0.0.1:P --rate 500 --duration-s 20 --out F.json
    python benchmarks/scale_load.py --urls U1,U2,... --concurrency 64 --duration-s 10 --out F.json

Writes {"sent", "ok", "failed", "errors": {text: count}, "duration_s", "achieved_rps", "lateness_p99_ms",
"latency_ms": [...], "failures": [[start_s, error], ...]}.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from pathlib import Path

import aiohttp

MAX_DURATION_S = 600


async def one(session: aiohttp.ClientSession, url: str, body: dict, headers: dict, out: dict, t0: float) -> None:
    started = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}")
        out["latency_ms"].append((time.perf_counter() - started) * 1000)
        out["ok"] += 1
    except Exception as exc:  # noqa: BLE001 - a failed request is recorded, not raised
        text = f"{type(exc).__name__}: {exc}"[:120]
        out["failed"] += 1
        out["errors"][text] = out["errors"].get(text, 0) + 1
        out["failures"].append([round(started - t0, 3), text])


async def run(args: argparse.Namespace) -> dict:
    urls = args.urls.split(",") if args.urls else [args.url]
    body = {"model": args.model, "prompt": "hello", "max_tokens": args.max_tokens}
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    out = {"sent": 0, "ok": 0, "failed": 0, "errors": {}, "latency_ms": [], "failures": [], "lateness_ms": []}
    duration = min(args.duration_s, MAX_DURATION_S)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        targets = itertools.cycle(urls)
        t0 = time.perf_counter()
        tasks: set[asyncio.Task] = set()
        if args.rate:
            for i in range(min(int(args.rate * duration), args.max_requests)):
                due = t0 + i / args.rate
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                out["lateness_ms"].append(max(0.0, -delay) * 1000)
                task = asyncio.create_task(one(session, next(targets), body, headers, out, t0))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                out["sent"] += 1
        else:
            deadline = t0 + duration

            async def client() -> None:
                while time.perf_counter() < deadline and out["sent"] < args.max_requests:
                    out["sent"] += 1
                    await one(session, next(targets), body, headers, out, t0)

            await asyncio.gather(*(client() for _ in range(args.concurrency)))
        sending_s = time.perf_counter() - t0
        if tasks:
            await asyncio.wait(tasks, timeout=args.timeout_s + 5)
        out["duration_s"] = time.perf_counter() - t0
    out["achieved_rps"] = out["ok"] / sending_s if sending_s else 0.0
    late = sorted(out.pop("lateness_ms"))
    out["lateness_p99_ms"] = late[int(0.99 * (len(late) - 1))] if late else 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url")
    parser.add_argument("--urls", help="comma-separated: round-robin over them (direct to the stand-ins)")
    parser.add_argument("--rate", type=float, default=0.0, help="requests per second (open loop)")
    parser.add_argument("--concurrency", type=int, default=16, help="clients of the closed loop (without --rate)")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--max-requests", type=int, default=1_000_000)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--model", default="stub")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--key")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    try:
        import uvloop
        result = uvloop.run(run(args))
    except ImportError:
        result = asyncio.run(run(args))
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
