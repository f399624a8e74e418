"""The scale benchmarks' load, as a process of its own (its CPU is its own): hpcserve's load generator
(hpcserve.benchmark.loadgen) sending non-streamed completions at a fixed rate (open loop: requests start
on schedule whatever the answers do) or from a closed loop of clients, against one URL (the endpoint) or
round-robin over many (the stand-ins directly). Bounded: nothing is sent after --duration-s (at most
600 s), at most --max-requests are sent, and the ones in flight get --timeout-s more.

    python benchmarks/scale_load.py --url http://127.0.0.1:P --rate 500 --duration-s 20 --out F.json
    python benchmarks/scale_load.py --urls U1,U2,... --concurrency 64 --duration-s 10 --out F.json

Writes {"sent", "ok", "failed", "errors": {text: count}, "duration_s", "achieved_rps", "lateness_p99_ms",
"latency_ms": [...], "failures": [[start_s, error], ...]}. Lateness: how long after its scheduled time
a request went out (open loop; a late client would hide a slow server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from hpcserve.benchmark.loadgen import (
    LoadResult,
    LoadShape,
    Repeated,
    RequestInput,
    run_load,
)
from hpcserve.benchmark.stats import percentile
from hpcserve.engine.client import Endpoint

MAX_DURATION_S = 600
ERROR_CHARS = 120


def figures(result: LoadResult, offsets: Repeated | list[float], open_loop: bool) -> dict:
    """The JSON scale.py reads, from the load generator's outputs. Pure."""
    ok = [o for o in result.outputs if o.ok]
    failed = [o for o in result.outputs if not o.ok]
    errors: dict[str, int] = {}
    for output in failed:
        errors[output.error[:ERROR_CHARS]] = errors.get(output.error[:ERROR_CHARS], 0) + 1
    lateness = [max(0.0, o.start_s - offsets[i]) * 1000 for i, o in zip(result.sent, result.outputs, strict=True)]
    # Open loop: the rate achieved while sending; closed loop: over the whole run.
    sending_s = max((o.start_s for o in result.outputs), default=0.0) if open_loop else result.duration_s
    return {"sent": len(result.outputs), "ok": len(ok), "failed": len(failed), "errors": errors,
            "duration_s": result.duration_s, "achieved_rps": len(ok) / sending_s if sending_s else 0.0,
            "lateness_p99_ms": (percentile(lateness, 99) or 0.0) if open_loop else 0.0,
            "latency_ms": [o.e2e_s * 1000 for o in ok],
            "failures": [[round(o.start_s, 3), o.error[:ERROR_CHARS]] for o in failed]}


async def run(args: argparse.Namespace) -> dict:
    urls = args.urls.split(",") if args.urls else [args.url]
    endpoints = [Endpoint(url.rstrip("/"), args.model, args.key) for url in urls]
    request = RequestInput("hello", args.max_tokens, stream=False)
    duration = min(args.duration_s, MAX_DURATION_S)
    if args.rate:
        count = min(int(args.rate * duration), args.max_requests)
        offsets: Repeated | list[float] = [i / args.rate for i in range(count)]
        shape = LoadShape(concurrency=None, request_rate=args.rate)
    else:
        count = args.max_requests
        offsets, shape = Repeated(0.0, count), LoadShape(concurrency=args.concurrency)
    result = await run_load(endpoints, Repeated(request, count), shape, offsets, ignore_eos=False,
                            timeout_s=duration + args.timeout_s + 5, send_window_s=duration)
    return figures(result, offsets, open_loop=bool(args.rate))


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
    if not (args.url or args.urls):
        parser.error("give --url or --urls")
    try:  # as vLLM's own client runs: the lighter the client, the less it takes from a shared machine
        import uvloop
        result = uvloop.run(run(args))
    except ImportError:
        result = asyncio.run(run(args))
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
