"""Router overhead: the same load sent straight to the backends and through the router, side by side in
one run (alternating blocks, the order flipped every block so drift of a shared machine hits both).

    .venv/bin/python benchmarks/router.py stub  [--blocks 8 --requests 200 --concurrency 1,16]
    flock /tmp/hpcserve-heavy.lock .venv/bin/python benchmarks/router.py vllm [--blocks 4 --requests 24]

`stub`: two fast OpenAI stand-ins (hpcserve.testing.standin) on loopback, so that a 1 ms difference
is not hidden by an engine's noise. `vllm`: two real vLLM engines (the builtin tiny model, one core each).
Direct traffic goes round-robin over the backends (what `hpcserve bench` did before the router); routed
traffic goes to the router's one URL. The load generator is hpcserve's own (hpcserve.benchmark.loadgen),
streaming with text prompts. Prints one table and, with --json, writes every figure.
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
from pathlib import Path

import httpx

from hpcserve.benchmark.loadgen import LoadShape, RequestInput, run_load
from hpcserve.benchmark.summary import percentile
from hpcserve.core.net import free_loopback_port as free_port
from hpcserve.endpoint.router import Router
from hpcserve.engine.client import Endpoint, completion_probe
from hpcserve.testing.harness import spawn, stop, wait_until

KEY = "router-bench-key"
PROMPT = "The quick brown fox jumps over the lazy dog and keeps running through the"


def start_stubs(directory: Path, output_len: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, urls = [], []
    for name in ("a", "b"):
        port = free_port()
        argv = [sys.executable, "-m", "hpcserve.testing.standin", "--port", str(port), "--name", name,
                "--tokens", str(output_len)]
        procs.append(spawn(argv, directory / f"stub-{name}.log", {"HPCSERVE_STUB_API_KEY": KEY}))
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        wait_until(lambda url=url: httpx.get(f"{url}/health", timeout=1).status_code == 200, 30, f"{url}/health")
    return procs, urls


def start_engines(directory: Path) -> tuple[list[subprocess.Popen], list[str]]:
    from hpcserve.models.tiny import tiny_model_path

    procs, urls = [], []
    for core in (0, 1):
        port = free_port()
        argv = [sys.executable, "-m", "hpcserve.engine.vllm_cli", "serve", str(tiny_model_path()),
                "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--max-model-len", "512"]
        env = {"VLLM_API_KEY": KEY, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core)}
        procs.append(spawn(argv, directory / f"engine-{core}.log", env))
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        wait_until(lambda url=url: completion_probe(url, "tiny", KEY, timeout_s=30) is not None, 600, f"a completion from {url}")
    return procs, urls


def block(endpoints: list[Endpoint], requests: int, concurrency: int, output_len: int) -> dict:
    """One block of `requests` streamed completions at `concurrency`; latency and throughput figures."""
    inputs = [RequestInput(prompt=f"{PROMPT} {i}", output_len=output_len) for i in range(requests)]
    result = asyncio.run(run_load(endpoints, inputs, LoadShape(concurrency=concurrency), [0.0] * requests,
                                  timeout_s=600))
    good = [o for o in result.outputs if o.ok]
    return {"e2e_ms": [o.e2e_s * 1000 for o in good], "ttft_ms": [o.ttft_s * 1000 for o in good],
            "failed": len(result.outputs) - len(good), "tokens": sum(o.output_tokens for o in good),
            "duration_s": result.duration_s}


def compare(direct: list[Endpoint], routed: list[Endpoint], blocks: int, requests: int, concurrency: int,
            output_len: int) -> dict:
    """Alternate direct and routed blocks; the order flips every block."""
    runs = {"direct": [], "router": []}
    block(direct, max(4, concurrency), concurrency, output_len)  # warm connections and caches, unmeasured
    block(routed, max(4, concurrency), concurrency, output_len)
    for index in range(blocks):
        order = ("direct", "router") if index % 2 == 0 else ("router", "direct")
        for mode in order:
            runs[mode].append(block(direct if mode == "direct" else routed, requests, concurrency, output_len))
    return {mode: summarize(blocks_) for mode, blocks_ in runs.items()}


def summarize(blocks: list[dict]) -> dict:
    e2e = [x for b in blocks for x in b["e2e_ms"]]
    ttft = [x for b in blocks for x in b["ttft_ms"]]
    duration = sum(b["duration_s"] for b in blocks)
    return {"requests": len(e2e), "failed": sum(b["failed"] for b in blocks),
            "p50_e2e_ms": percentile(e2e, 50), "p50_ttft_ms": percentile(ttft, 50), "p99_e2e_ms": percentile(e2e, 99),
            "req_per_s": len(e2e) / duration, "tokens_per_s": sum(b["tokens"] for b in blocks) / duration,
            "block_req_per_s": [len(b["e2e_ms"]) / b["duration_s"] for b in blocks]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend", choices=["stub", "vllm"])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--requests", type=int, default=200, help="requests per block")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--policy", default="round_robin", help="the router's policy (see router_main.POLICIES)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="router-bench-"))
    key_path = directory / "api_key"
    key_path.write_text(KEY)
    key_path.chmod(0o600)
    model = "stub" if args.backend == "stub" else "tiny"
    procs, urls = (start_stubs(directory, args.output_len) if args.backend == "stub" else start_engines(directory))
    router = Router("127.0.0.1", free_port(), key_path, directory / "router.log", policy=args.policy)
    results = {"backend": args.backend, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "args": {k: str(v) for k, v in vars(args).items()},
               "points": []}
    try:
        router.start(urls)
        direct = [Endpoint(url, model, KEY) for url in urls]
        routed = [Endpoint(router.url, model, KEY)]
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            point = compare(direct, routed, args.blocks, args.requests, concurrency, args.output_len)
            point["concurrency"] = concurrency
            point["added_p50_ms"] = point["router"]["p50_e2e_ms"] - point["direct"]["p50_e2e_ms"]
            point["added_p50_ttft_ms"] = point["router"]["p50_ttft_ms"] - point["direct"]["p50_ttft_ms"]
            point["throughput_ratio"] = point["router"]["req_per_s"] / point["direct"]["req_per_s"]
            results["points"].append(point)
            print_point(point)
    finally:
        router.stop()
        router.close()
        for proc in procs:
            stop(proc)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def print_point(p: dict) -> None:
    d, r = p["direct"], p["router"]
    print(f"concurrency {p['concurrency']:>3}: p50 e2e direct {d['p50_e2e_ms']:.2f} ms, "
          f"router {r['p50_e2e_ms']:.2f} ms "
          f"(+{p['added_p50_ms']:.2f} ms; TTFT +{p['added_p50_ttft_ms']:.2f} ms); "
          f"req/s direct {d['req_per_s']:.1f}, router {r['req_per_s']:.1f} (x{p['throughput_ratio']:.3f}); "
          f"failed {d['failed']}/{r['failed']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
