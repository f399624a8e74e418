"""Tables of benchmarks/results/gpu.md's section on issue 20 part 3 (2026-12-02, third session): TTFT below
saturation, open loop. Reads this folder's routing.jsonl (one line per run: the client's summary and both
replicas' vLLM metric deltas) and callN-raw.tar.gz (the client's per-request records).

usage: python3 analyse.py            (from anywhere; standard library only)
"""

from __future__ import annotations

import json
import statistics
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CALLS = (6, 7, 8)  # the device calls whose routing runs routing.jsonl holds, in order
RR_SATURATION = 30.7  # req/s: round robin's closed-loop throughput on `pre` (second session: 30.7 and 32.3)


def pct(v: list[float], q: float) -> float | None:
    if not v:
        return None
    v = sorted(v)
    return v[min(len(v) - 1, round(q / 100 * (len(v) - 1)))]


def runs() -> list[dict]:
    out, call = [], None
    lines = [json.loads(x) for x in (HERE / "routing.jsonl").read_text().splitlines() if x.strip()]
    calls = iter(CALLS)
    for d in lines:
        if d.get("phase") != "routing":
            continue
        if d.get("step") == "replicas":
            call = next(calls)
            continue
        d["call"] = call
        out.append(d)
    return out


def requests(run: dict) -> list[dict]:
    pol = run["policy"].replace(":", "-")
    name = f"./client_{run['run']}_pre_r{run['rate']}_{pol}.requests.jsonl"
    with tarfile.open(HERE / f"call{run['call']}-raw.tar.gz") as t:
        return [json.loads(x) for x in t.extractfile(name).read().decode().splitlines()]


def main() -> None:
    rows = []
    for r in runs():
        s, m = r["client"], r["metrics"]
        reqs = [q for q in requests(r) if q["ok"]]
        hit = [q["ttft"] * 1e3 for q in reqs if q["cached_tokens"] >= 0.5 * q["prompt_tokens"]]
        miss = [q["ttft"] * 1e3 for q in reqs if q["cached_tokens"] < 0.5 * q["prompt_tokens"]]
        computed = m["prefix_cache_queries"] - m["prefix_cache_hits"]  # prompt tokens prefilled
        rows.append({"call": r["call"], "run": r["run"], "rate": r["rate"], "policy": r["policy"].split(":")[-1],
                     "seed": r["seed"], "p50": s["ttft_p50_ms"], "p99": s["ttft_p99_ms"], "mean": s["ttft_mean_ms"],
                     "tok_s": s["output_tok_s"], "req_s": s["req_s"], "offered": s["offered_req_s"],
                     "hit_rate": m["hit_rate"], "hit_frac": s["hit_request_fraction"],
                     "hit_p50": s["ttft_p50_ms_hits"], "miss_p50": s["ttft_p50_ms_misses"],
                     "miss_p10": round(pct(miss, 10), 1), "hit_p90": round(pct(hit, 90), 1),
                     "computed_M": round(computed / 1e6, 3), "failed": s["failed"], "max_in_flight": s["max_in_flight"],
                     "e2e_p50": s["e2e_p50_ms"], "tpot": s["tpot_mean_ms"]})
    print("| rate | call.run | policy | seed | offered req/s | TTFT p50 / p99 ms | TTFT mean ms | output tok/s | hit rate "
          "(vLLM, tokens) | hit_request_fraction | TTFT p50 hits / misses ms | misses p10 ms | prompt tokens "
          "prefilled (M) | max in flight | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for w in sorted(rows, key=lambda w: (w["rate"], w["policy"] != "round_robin", w["call"], w["run"])):
        print(f"| {w['rate']} | {w['call']}.{w['run']} | {w['policy']} | {w['seed']} | {w['offered']} | {w['p50']} / {w['p99']} | "
              f"{w['mean']} | {w['tok_s']} | {w['hit_rate']} | {w['hit_frac']} | {w['hit_p50']} / {w['miss_p50']} | "
              f"{w['miss_p10']} | {w['computed_M']} | {w['max_in_flight']} | {w['failed']} |")
    print()
    print("| rate | TTFT p50 prefix / round robin (means of two runs) | each ABBA pair | TTFT p99 ratio | "
          "hit_request_fraction rr / prefix | goal <= 0.6 |")
    print("|---|---|---|---|---|---|")
    for rate in sorted({w["rate"] for w in rows}):
        rr = [w for w in rows if w["rate"] == rate and w["policy"] == "round_robin"]
        px = [w for w in rows if w["rate"] == rate and w["policy"] == "prefix"]
        mean = lambda ws, k: statistics.mean(w[k] for w in ws)  # noqa: E731
        ratio = mean(px, "p50") / mean(rr, "p50")
        # ABBA pairs: the runs in order, each prefix run with the round-robin run next to it in its call
        pairs = []
        for p in px:
            mate = min((w for w in rr if w["call"] == p["call"]), key=lambda w: abs(w["run"] - p["run"]))
            pairs.append(round(p["p50"] / mate["p50"], 2))
        print(f"| {rate} | {ratio:.2f} ({mean(px, 'p50'):.1f} / {mean(rr, 'p50'):.1f} ms) | {', '.join(map(str, pairs))} | "
              f"{mean(px, 'p99') / mean(rr, 'p99'):.2f} | {mean(rr, 'hit_frac'):.3f} / {mean(px, 'hit_frac'):.3f} | "
              f"{verdict(rate, ratio, pairs)} |")


def verdict(rate: float, ratio: float, pairs: list[float]) -> str:
    if rate >= 0.95 * RR_SATURATION:
        return "not below saturation (round robin's queue grows): not counted"
    if ratio <= 0.6:
        return "met" if max(pairs) <= 0.6 else "met on the mean, not in every pair"
    return "not met"


if __name__ == "__main__":
    main()
