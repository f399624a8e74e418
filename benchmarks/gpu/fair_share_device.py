"""Fair share on engines already serving (the GPU device's replicas, fair_share_device.sh starts them):
benchmarks/tenancy_fair_share.py's phases and modes, with B's rate set from A's.

    PYTHONPATH=src:benchmarks:benchmarks/gpu python3 fair_share_device.py --urls URL1,URL2 --max-num-seqs S
        [--a-in-flight 64] [--tokens 128] [--vary-tokens 0] [--phase-s 35] [--b-rate 0] [--workers 1] [--rounds 1]
        [--ready-s 300]
        [--logs DIR] [--json F]

The engines must serve the model name tenancy_fair_share.py's requests ask for ("tiny") and take no key.
Until each answers a completion (--ready-s), nothing starts. Then two data planes in front of both engines,
each told the engines' --max-num-seqs as their capacity, as tenancy_fair_share.py sets them up: one with
tenancy (A's and B's own keys, projects of equal shares: fair share), one with the deployment's key alone
(first come first served). --b-rate 0: B sends a tenth of A's request rate, A's rate measured alone through
the second for 10 s first (which also warms the engines). Then tenancy_fair_share.run: per mode a 5 s warm-up
of A, then B alone, A alone, A and B for --phase-s each (with --rounds N, A alone and A and B N times, the
modes taking turns; the figures are the rounds' medians). Prints the figures and the targets (B's TTFT p50 with A
within 1.25 x B's alone; the pool's tokens/s with B >= 0.97 x A's alone), and the whole result as JSON (--json).
--logs: the data planes' logs are copied there before the temporary folder goes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from tenancy_bench import finish, workspace
from tenancy_fair_share import MODES, mode_targets, modes, run_calibrated

from hpcserve.engine.client import completion_probe

MODEL = "tiny"  # what tenancy_fair_share.stream asks for
TARGET_B_TTFT, TARGET_THROUGHPUT = 1.25, 0.97


def wait_engines(urls: list[str], ready_s: float) -> float:
    """Seconds until every engine answered a completion; SystemExit after ready_s."""
    started = time.monotonic()
    waiting = list(urls)
    while waiting:
        try:
            completion_probe(waiting[0], MODEL, None, timeout_s=30, max_tokens=4)
            waiting.pop(0)
            continue
        except Exception as exc:  # noqa: BLE001 - not serving yet (refused, 404 while loading, a 5xx)
            last = exc
        if time.monotonic() - started > ready_s:
            raise SystemExit(f"{waiting[0]} did not answer a completion within {ready_s:.0f} s: {last}")
        time.sleep(1.0)
    return round(time.monotonic() - started, 1)


def engine_figures(point: dict) -> str:
    """The engines' own tokens/s (within each phase, without the clients' tail) and their ratio."""
    ratio = point.get("engine_throughput_ratio")
    if ratio is None:
        return "-"
    return (f"{point['A alone']['engine_tokens_per_s']}, {point['A and B']['engine_tokens_per_s']}, {ratio} "
            f"{'met' if ratio >= TARGET_THROUGHPUT else 'NOT met'}")


def verdict(results: dict) -> list[str]:
    lines = [("| mode | B alone TTFT p50 s | A and B: B TTFT p50 s | B ratio (<= 1.25) | A alone tok/s | A and B tok/s "
              "| throughput ratio (>= 0.97) | engines' tok/s: A alone, A and B, ratio (>= 0.97) | failed "
              "| A and B: B's mean TTFT s, of it waited in admission | A's streams paused for B "
              "| data plane's cores busy: A alone, A and B | rounds' throughput ratios |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        p = results.get(mode)
        if not p:
            continue
        failed = sum(p[k]["failed"] for k in ("B alone", "A alone", "A and B"))
        lines.append(f"| {mode} | {p['B alone']['b_ttft_p50_s']:.3f} | {p['A and B']['b_ttft_p50_s']:.3f} | "
                     f"{p['b_ttft_ratio']} {'met' if p['b_ttft_ratio'] <= TARGET_B_TTFT else 'NOT met'} | "
                     f"{p['A alone']['tokens_per_s']} | {p['A and B']['tokens_per_s']} | {p['throughput_ratio']} "
                     f"{'met' if p['throughput_ratio'] >= TARGET_THROUGHPUT else 'NOT met'} | {engine_figures(p)} | {failed} | "
                     f"{p['A and B']['b_ttft_mean_s']}, {p['A and B'].get('b_wait_mean_s', '-')} | "
                     f"{p['A and B'].get('pauses', '-')} | {p['A alone'].get('plane_cores', '-')}, "
                     f"{p['A and B'].get('plane_cores', '-')} | "
                     f"{', '.join(str(r['throughput_ratio']) for r in p.get('rounds', [])) or '-'} |")
    if "lone_user_ratio" in results:
        lines.append(f"\nA alone, fair share over first come first served (tokens/s): {results['lone_user_ratio']}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--urls", required=True, help="the engines, comma-separated")
    parser.add_argument("--max-num-seqs", type=int, required=True, help="the engines' (the data planes' capacity)")
    parser.add_argument("--a-in-flight", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--vary-tokens", type=float, default=0.0, help="as tenancy_fair_share.py's")
    parser.add_argument("--phase-s", type=float, default=35.0)
    parser.add_argument("--b-rate", type=float, default=0.0, help="B's requests/s; 0: a tenth of A's, measured")
    parser.add_argument("--workers", type=int, default=1, help="data-plane workers")
    parser.add_argument("--rounds", type=int, default=1, help="as tenancy_fair_share.py's")
    parser.add_argument("--modes", default="fair,fcfs", help="as tenancy_fair_share.py's")
    parser.add_argument("--ready-s", type=float, default=300.0)
    parser.add_argument("--logs", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    urls = [u.rstrip("/") for u in args.urls.split(",") if u]
    args.engines = urls  # tenancy_fair_share.phase reads their occupancy (running / max-num-seqs) from /metrics
    print(f"engines ready after {wait_engines(urls, args.ready_s)} s of waiting", flush=True)
    with workspace("hpcserve-fair-gpu-") as here:
        try:
            targets = mode_targets(here, urls, args.max_num_seqs, MODEL, args.workers, modes(args.modes))
            results = run_calibrated(targets, args, min_b_rate=0.05)
            print("\n".join(verdict(results)), flush=True)
            finish(results, args)
        finally:
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                for log in here.folder.glob("plane-*.log"):
                    shutil.copy(log, args.logs / log.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
