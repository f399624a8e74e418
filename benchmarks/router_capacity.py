"""Heterogeneous pools (issue 11.5): does traffic follow each replica's capacity through the router?

    .venv/bin/python benchmarks/router_capacity.py [--requests 400 --concurrency 16 --slots 4,1]

Two OpenAI stand-ins (hpcserve.testing.standin) of unequal capacity on loopback: each runs at most
`slots` requests at once and queues the rest, as an engine with `--max-num-seqs` does, at the same
per-token speed, so capacity is in proportion to slots. A closed loop of `concurrency` clients sends
`requests` completions through vllm-router under each of its policies, then with round_robin plus
hpcserve's load-aware rotation (endpoint/router.py's Rotation, one round every --rotation-s, as the
endpoint's controller runs it). Prints each backend's share of the requests and the throughput against
the ideal (shares in proportion to slots, throughput = the pool's capacity).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from hpcserve.core.net import free_loopback_port as free_port
from hpcserve.endpoint.rotation import Rotation
from hpcserve.endpoint.router import Router
from hpcserve.engine.client import health_ok
from hpcserve.testing.harness import spawn, stop, wait_until

TOKENS, TOKEN_DELAY_MS = 16, 5.0
POLICIES = ("round_robin", "random", "power_of_two", "cache_aware")


async def closed_loop(url: str, requests: int, concurrency: int) -> tuple[dict[str, int], float]:
    """Backend name -> requests it answered, and requests per second."""
    served: dict[str, int] = {}
    slots = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        async def one(i: int) -> None:
            async with slots:
                response = await client.post(f"{url}/v1/completions", json={
                    "model": "stub", "prompt": f"request {i}", "max_tokens": TOKENS})
                response.raise_for_status()
                name = response.headers["x-backend"]
                served[name] = served.get(name, 0) + 1

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        return served, requests / (time.perf_counter() - started)


def rotate(router: Router, backends: list[str], stop_event: threading.Event, period_s: float) -> None:
    """The controller's load-aware rotation alone (endpoint/controller.py: Endpoint.rotate)."""
    rotation = Rotation(router)
    while not stop_event.wait(period_s):
        loads = {url: router.engine_load(url, timeout_s=period_s) for url in backends}
        rotation.update(backends, {url for url, load in loads.items() if load is not None}, loads)


def measure(policy: str, backends: list[str], args: argparse.Namespace, logs: Path, rotation_s: float | None) -> tuple:
    router = Router("127.0.0.1", free_port(), None, logs / f"router-{policy}.log", policy=policy)
    router.start(backends)
    stop_event = threading.Event()
    rotator = threading.Thread(target=rotate, args=(router, backends, stop_event, rotation_s or 1.0), daemon=True)
    try:
        if rotation_s:
            rotator.start()
        return asyncio.run(closed_loop(router.url, args.requests, args.concurrency))
    finally:
        stop_event.set()
        if rotation_s:
            rotator.join()
        router.stop()
        router.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--slots", default="4,1", help="each stand-in's concurrent requests, comma-separated")
    parser.add_argument("--rotation-s", default="1,0.1", help="rounds of the load-aware rotation to try")
    args = parser.parse_args()
    slots = [int(s) for s in args.slots.split(",")]
    names = [f"b{i}-{s}slots" for i, s in enumerate(slots)]
    logs = Path(tempfile.mkdtemp(prefix="router-capacity-"))
    ports = [free_port() for _ in slots]
    stubs = [spawn([sys.executable, "-m", "hpcserve.testing.standin", "--port", str(port),
                    "--name", name, "--slots", str(s), "--tokens", str(TOKENS),
                    "--token-delay-ms", str(TOKEN_DELAY_MS)], logs / f"{name}.log")
             for port, name, s in zip(ports, names, slots)]
    backends = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url in backends:
            wait_until(lambda url=url: health_ok(url), 30, f"{url}/health")
        capacity = sum(s / (TOKENS * TOKEN_DELAY_MS / 1000) for s in slots)
        ideal = "  ".join(f"{n} {s / sum(slots):.2f}" for n, s in zip(names, slots))
        print(f"ideal shares: {ideal}; ideal throughput {capacity:.1f} req/s (concurrency {args.concurrency})")
        runs = [(p, None) for p in POLICIES] + [("round_robin", float(s)) for s in args.rotation_s.split(",")]
        for policy, rotation_s in runs:
            served, rate = measure(policy, backends, args, logs, rotation_s)
            shares = "  ".join(f"{n} {served.get(n, 0) / args.requests:.2f}" for n in names)
            label = policy + (f" + hpcserve rotation ({rotation_s:g} s)" if rotation_s else "")
            print(f"{label:40s} {shares}   {rate:6.1f} req/s ({rate / capacity:.2f} of ideal)")
    finally:
        for proc in stubs:
            stop(proc)
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
