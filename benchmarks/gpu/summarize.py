"""Tables for benchmarks/results/gpu.md from ttft_h200.sh's runs.jsonl (one line per run, in run order).

usage: summarize.py RUNS.jsonl
Prints one row per run, then hpcserve / plain ratios for every adjacent (plain, hpcserve) pair of runs
and their median: in an alternating sequence each run is compared with both neighbours, so both orders
(plain first, hpcserve first) are counted.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def adjacent_pairs(runs: list[dict]) -> list[tuple[dict, dict, str]]:
    """(plain, hpcserve, order) for every two neighbouring runs of different sides. Pure."""
    pairs = []
    for first, second in zip(runs, runs[1:]):
        sides = (first["side"], second["side"])
        if sides == ("plain", "hpc"):
            pairs.append((first, second, "plain first"))
        elif sides == ("hpc", "plain"):
            pairs.append((second, first, "hpcserve first"))
    return pairs


def ratios(plain: dict, hpc: dict) -> dict[str, float]:
    p, h = plain["bench"], hpc["bench"]
    return {"output_tok_s": h["output_throughput"] / p["output_throughput"],
            "ttft_p50": h["median_ttft_ms"] / p["median_ttft_ms"],
            "ttft_p99": h["p99_ttft_ms"] / p["p99_ttft_ms"],
            "tpot_p50": h["median_tpot_ms"] / p["median_tpot_ms"]}


def run_row(index: int, run: dict) -> str:
    b = run["bench"]
    side = "hpcserve" if run["side"] == "hpc" else "plain vLLM"
    return (f"| {index} | {side} | {run['cache']} | {run['ready_s']:.1f} s | {b['output_throughput']:.0f} | "
            f"{b['median_ttft_ms']:.1f} | {b['p99_ttft_ms']:.1f} | {b['median_tpot_ms']:.2f} |")


def main(path: str) -> None:
    runs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    runs = [r for r in runs if r.get("bench")]
    print("| run | side | compile cache | ready | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for i, run in enumerate(runs, 1):
        print(run_row(i, run))
    index = {id(r): i for i, r in enumerate(runs, 1)}
    print("\n| pair (runs) | order | output tok/s ratio | TTFT p50 ratio | TTFT p99 ratio | TPOT p50 ratio |")
    print("|---|---|---|---|---|---|")
    table = []
    for plain, hpc, order in adjacent_pairs(runs):
        r = ratios(plain, hpc)
        table.append(r)
        print(f"| {index[id(plain)]}, {index[id(hpc)]} | {order} | {r['output_tok_s']:.3f} | {r['ttft_p50']:.3f} | "
              f"{r['ttft_p99']:.3f} | {r['tpot_p50']:.3f} |")
    if table:
        med = {k: statistics.median(t[k] for t in table) for k in table[0]}
        print(f"| median | | {med['output_tok_s']:.3f} | {med['ttft_p50']:.3f} | {med['ttft_p99']:.3f} | "
              f"{med['tpot_p50']:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1])
