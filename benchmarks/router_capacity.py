"""Heterogeneous pools: does traffic follow each replica's capacity through the data plane?

    flock /tmp/hpcserve-heavy.lock .venv/bin/python benchmarks/router_capacity.py [--requests 400 --concurrency 16 --slots 4,1]

Two OpenAI stand-ins (hpcserve.testing.standin) of unequal capacity on loopback: each runs at most
`slots` requests at once and queues the rest, as an engine with `--max-num-seqs` does, at the same
per-token speed, so capacity is in proportion to slots. A closed loop of `concurrency` clients sends
`requests` completions through hpcserve's data plane under each policy (least_loaded with the
capacities the controller would set from --max-num-seqs, least_loaded without them, round_robin, prefix)
and through vllm-router (round_robin, power_of_two), the data plane it replaced. Prints each backend's
share of the requests and the throughput against the ideal (shares in proportion to slots, throughput =
the pool's capacity).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
from vllm_router_launch import VllmRouter

from hpcserve.core.net import free_loopback_port as free_port
from hpcserve.core.statuses import Routing
from hpcserve.endpoint.control.plane_client import Router
from hpcserve.endpoint.protocol import BackendSpec
from hpcserve.engine.client import health_ok
from hpcserve.testing.harness import spawn, stop, wait_until

TOKENS, TOKEN_DELAY_MS = 16, 5.0


async def closed_loop(url: str, requests: int, concurrency: int) -> tuple[dict[str, int], float]:
    """Backend name -> requests it answered, and requests per second."""
    served: dict[str, int] = {}
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, trust_env=False, limits=limits) as client:
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


def through_dataplane(policy: Routing, capacities: list[int] | None, backends: list[str], args, logs: Path):
    label = f"hpcserve {policy}" + (" (capacities set)" if capacities else " (capacities unknown)")
    router = Router("127.0.0.1", free_port(), None, logs / f"dataplane-{policy}.log", policy=policy,
                    admin_socket=logs / f"dp-{policy}" / "admin.sock")
    router.start([])
    try:
        router.set_backends([BackendSpec(url, cap) for url, cap in zip(backends, capacities or [256] * len(backends))])
        return label, asyncio.run(closed_loop(router.url, args.requests, args.concurrency))
    finally:
        router.stop()
        router.close()


def through_vllm_router(policy: str, backends: list[str], args, logs: Path):
    router = VllmRouter(free_port(), None, logs / f"vllm-router-{policy}.log", policy=policy, metrics_port=free_port())
    router.start(backends)
    try:
        return f"vllm-router {policy}", asyncio.run(closed_loop(router.url, args.requests, args.concurrency))
    finally:
        router.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--slots", default="4,1", help="each stand-in's concurrent requests, comma-separated")
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
        runs = [lambda: through_dataplane(Routing.LEAST_LOADED, slots, backends, args, logs),
                lambda: through_dataplane(Routing.LEAST_LOADED, None, backends, args, logs),
                lambda: through_dataplane(Routing.ROUND_ROBIN, slots, backends, args, logs),
                lambda: through_dataplane(Routing.PREFIX, slots, backends, args, logs),
                lambda: through_vllm_router("round_robin", backends, args, logs),
                lambda: through_vllm_router("power_of_two", backends, args, logs)]
        for run in runs:
            label, (served, rate) = run()
            shares = "  ".join(f"{n} {served.get(n, 0) / args.requests:.2f}" for n in names)
            print(f"| {label:42s} | {shares} | {rate:6.1f} req/s | {rate / capacity:.2f} of ideal |", flush=True)
    finally:
        for proc in stubs:
            stop(proc)
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
