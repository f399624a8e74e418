"""The tables of benchmarks/results/routing.md from routing_device.sh's results.jsonl (one line per run).

    python3 benchmarks/gpu/routing_summary.py RESULTS.jsonl [--targets]

Per workload: every run (round, seed, policy) with output tok/s, TTFT p50/p99, TPOT mean, vLLM's prefix-cache
hit tokens (both replicas, from /metrics), the client's best possible hit tokens and hits / best, failed
requests and the split over the replicas; then per round (the same seed for every policy) the ratios
hpcserve / cache_aware and hpcserve / round robin (stress: hpcserve / direct) of output tok/s and TTFT p50,
with their mean and range; then the routing targets with what was measured (--targets: only
those). The workers phase (dataplane_workers.py) gets its own table. Other data planes measured in the
same rounds (routing_device.sh's hps:prefix@TAG) get their own ratio rows; every policy its hits / best.
Tenancy (data planes of ROUTING_TENANCY_<TAG>): per round, tenancy on against off and against direct (output
tok/s, TTFT p50), and each on run's usage rows against the requests its client sent.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HPS = "hps:prefix"
NAMES = {"hps:prefix": "hpcserve prefix", "cache_aware": "vllm-router cache_aware",
         "round_robin": "vllm-router round_robin", "direct": "direct (client round robin)"}
WORKLOADS = ("fit", "evict", "chat", "stress")
WARMUPS, WARMUP_TOKENS = 8, 4  # prefix_client.py's warm-ups: they carry the users' keys too


def name(policy: str) -> str:
    base, _, tag = (policy or "").partition("@")
    return NAMES.get(base, base) + (f" @{tag}" if tag else "")


def load(path: str) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def run_figures(r: dict) -> dict:
    c, m = r.get("client") or {}, r.get("metrics") or {}
    hits, best = m.get("prefix_cache_hits"), c.get("best_hit_tokens")
    split = [x.get("request_success") for x in m.get("replicas", [])]
    return {"tok_s": c.get("output_tok_s"), "p50": c.get("ttft_p50_ms"), "p99": c.get("ttft_p99_ms"),
            "tpot": c.get("tpot_mean_ms"), "hits": int(hits) if hits is not None else None, "best": best,
            "frac": (hits / best) if hits is not None and best else None, "failed": c.get("failed"),
            "lru": (hits / c["lru_hit_tokens"]) if hits is not None and c.get("lru_hit_tokens") else None,
            "ok": c.get("ok"), "split": "/".join(str(int(s)) for s in split if s is not None),
            "preempt": m.get("num_preemptions"), "hit_rate": m.get("hit_rate")}


def ratio_stats(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f}, {len(values)} rounds)"


def workload_tables(rows: list[dict], wl: str) -> tuple[list[str], dict]:
    runs = [r for r in rows if r.get("phase") == "rt" and r.get("workload") == wl and r.get("ok")]
    done = {(r.get("round"), r.get("policy")) for r in runs}
    done_rounds = {r.get("round") for r in runs}
    skipped = [r for r in rows if r.get("phase") == "rt" and r.get("workload") == wl and r.get("skipped")  # not run since
               and (r.get("round"), r.get("policy")) not in done and not (r.get("policy") is None and r.get("round") in done_rounds)]
    out: list[str] = []
    ratios: dict = {}
    if not runs:
        if skipped:
            out += [f"### {wl}", "", f"no run: {len(skipped)} skipped (budget or no data plane)", ""]
        return out, ratios
    c0 = runs[0].get("client") or {}
    out += [f"### {wl}", "",
            f"KV cache {fmt(runs[0].get('kv_tokens'))} tokens a replica; data plane args "
            f"'{runs[0].get('hps_args') or ''}', kv_tokens sent: {bool(runs[0].get('hps_kv'))}; "
            f"{c0.get('requests')} requests a run.", "",
            "| round | seed | policy | output tok/s | TTFT p50 / p99 ms | TPOT mean ms | hit tokens (vLLM) | best possible "
            "| hits / best | failed | split | preemptions |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (r.get("round", 0), r.get("run", 0))):
        f = run_figures(r)
        out.append(f"| {r.get('round')} | {r.get('seed')} | {name(r.get('policy'))} | {fmt(f['tok_s'])} | "
                   f"{fmt(f['p50'])} / {fmt(f['p99'])} | {fmt(f['tpot'], 2)} | {fmt(f['hits'])} | {fmt(f['best'])} | "
                   f"{fmt(f['frac'], 3)} | {fmt(f['failed'])} | {f['split']} | {fmt(f['preempt'], 0)} |")
    out.append("")
    by_round: dict[int, dict[str, dict]] = {}
    for r in runs:
        by_round.setdefault(r.get("round", 0), {})[r.get("policy")] = run_figures(r)
    others = [p for p in ("cache_aware", "round_robin", "direct") if any(p in d for d in by_round.values())]
    if HPS in {p for d in by_round.values() for p in d} and others:
        out += ["| round | " + " | ".join(f"hps / {o}: tok/s | TTFT p50" for o in others) + " |",
                "|---|" + "---|---|" * len(others)]
        for rnd in sorted(by_round):
            d = by_round[rnd]
            cells = []
            for o in others:
                h, b = d.get(HPS), d.get(o)
                if h and b and h["tok_s"] and b["tok_s"]:
                    t = h["tok_s"] / b["tok_s"]
                    ratios.setdefault((o, "tok_s"), []).append(t)
                    cells.append(f"{t:.3f}")
                else:
                    cells.append("-")
                if h and b and h["p50"] and b["p50"]:
                    q = h["p50"] / b["p50"]
                    ratios.setdefault((o, "p50"), []).append(q)
                    cells.append(f"{q:.3f}")
                else:
                    cells.append("-")
            out.append(f"| {rnd} | " + " | ".join(cells) + " |")
        out.append("| mean (range) | " + " | ".join(f"{ratio_stats(ratios.get((o, 'tok_s'), []))} | "
                                                  f"{ratio_stats(ratios.get((o, 'p50'), []))}" for o in others) + " |")
        out.append("")
    variants = sorted({p for d in by_round.values() for p in d if p.startswith(HPS + "@")})
    if variants:  # other data planes in the same rounds: each against every other policy of its round
        pols = [HPS] + variants + others
        out += ["| round | data plane | " + " | ".join(f"tok/s / {name(o)}" for o in pols) + " |",
                "|---|---|" + "---|" * len(pols)]
        for rnd in sorted(by_round):
            d = by_round[rnd]
            for v in [HPS] + variants:
                cells = [f"{d[v]['tok_s'] / d[o]['tok_s']:.3f}" if v in d and o in d and d[v]["tok_s"] and d[o]["tok_s"]
                         else "-" for o in pols]
                out.append(f"| {rnd} | {name(v)} | " + " | ".join(cells) + " |")
        out.append("")
    by_policy: dict[str, list] = {}
    for r in runs:
        by_policy.setdefault(r.get("policy"), []).append(run_figures(r))
    # hits / LRU: against the same cache evicting as the engines do (prefix_client's lru_hit_tokens)
    out += ["| policy | hits / best: mean (range) | hits / LRU: mean (range) | output tok/s: mean (range) |",
            "|---|---|---|---|"]
    for pol, figs in by_policy.items():
        fracs = [f["frac"] for f in figs if f["frac"] is not None]
        lrus = [f["lru"] for f in figs if f["lru"] is not None]
        toks = [f["tok_s"] for f in figs if f["tok_s"]]
        tok = (f"{statistics.mean(toks):,.1f} ({min(toks):,.1f}-{max(toks):,.1f})" if len(toks) > 1
               else fmt(toks[0]) if toks else "-")
        out.append(f"| {name(pol)} | {ratio_stats(fracs)} | {ratio_stats(lrus)} | {tok} |")
    out.append("")
    fr = [run_figures(r)["frac"] for r in runs if r.get("policy") == HPS and run_figures(r)["frac"] is not None]
    if fr:
        ratios[("hits", "frac")] = fr
    if skipped:
        out += [f"({len(skipped)} run(s) or round(s) skipped: budget or no data plane)", ""]
    return out, ratios


def tenancy_mode(r: dict) -> str | None:
    """'on' (users' keys), 'off' (the deployment's key alone), 'direct', else None (not part of a tenancy run)."""
    if r.get("policy") == "direct":
        return "direct"
    t = r.get("tenancy")
    if not isinstance(t, dict):
        return None
    return "on" if t.get("users") else "off"


def usage_check(r: dict) -> str:
    """Whether every request of an on run left one usage row with its tokens. Pure."""
    t, c = r.get("tenancy") or {}, r.get("client") or {}
    if "user_rows" not in t or c.get("requests") is None:
        return "no count"
    sent = c["requests"] + WARMUPS
    tokens = (c.get("completion_tokens") or 0) + WARMUPS * WARMUP_TOKENS
    ok = (t["user_rows"] == sent and set(t.get("statuses") or {}) <= {"200"} and not t.get("rows_without_tokens")
          and t.get("completion_tokens") == tokens)
    return (f"{'yes' if ok else 'NO'}: {t['user_rows']} rows / {sent} sent, {t.get('keys_seen')} keys, statuses "
            f"{t.get('statuses')}, completion tokens {t.get('completion_tokens')} / {tokens}")


def tenancy_tables(rows: list[dict]) -> tuple[list[str], dict]:
    """On against off and direct, per workload and round (the same seed), with the usage rows' check."""
    out: list[str] = []
    ratios: dict = {}
    for wl in WORKLOADS:
        runs = [r for r in rows if r.get("phase") == "rt" and r.get("workload") == wl and r.get("ok")]
        by_round: dict[int, dict[str, dict]] = {}
        for r in runs:
            mode = tenancy_mode(r)
            if mode:
                by_round.setdefault(r.get("round", 0), {})[mode] = r
        by_round = {k: v for k, v in by_round.items() if "on" in v}
        if not by_round:
            continue
        out += [f"### tenancy: {wl}", "", ("| round | on: output tok/s | TTFT p50 ms | on / off: tok/s | TTFT p50 | "
                                          "on / direct: tok/s | TTFT p50 | off / direct: tok/s | usage rows: every "
                                          "request once |"),
                "|---|---|---|---|---|---|---|---|---|"]
        for rnd in sorted(by_round):
            d = {m: run_figures(r) for m, r in by_round[rnd].items()}
            cells = []
            for a, b in (("on", "off"), ("on", "direct"), ("off", "direct")):
                for key in ("tok_s", "p50") if a == "on" else ("tok_s",):
                    x, y = d.get(a, {}).get(key), d.get(b, {}).get(key)
                    if x and y:
                        ratios.setdefault((wl, f"{a}/{b}", key), []).append(x / y)
                    cells.append(f"{x / y:.3f}" if x and y else "-")
            out.append(f"| {rnd} | {fmt(d['on']['tok_s'])} | {fmt(d['on']['p50'])} | " + " | ".join(cells)
                       + f" | {usage_check(by_round[rnd]['on'])} |")
        out.append("| mean (range) | | | " + " | ".join(
            ratio_stats(ratios.get((wl, pair, key), [])) for pair, key in
            (("on/off", "tok_s"), ("on/off", "p50"), ("on/direct", "tok_s"), ("on/direct", "p50"), ("off/direct", "tok_s")))
            + " | |")
        out.append("")
    return out, ratios


def targets(all_ratios: dict, rows_in: list[dict] | None = None) -> list[str]:
    def get(wl, key):
        return all_ratios.get(wl, {}).get(key, [])

    rows = [("(a) fit: output tok/s hps / cache_aware", get("fit", ("cache_aware", "tok_s")), ">= 1.05", 1.05, True),
            ("(b) evict: output tok/s hps / cache_aware", get("evict", ("cache_aware", "tok_s")), ">= 1.05", 1.05, True),
            ("(a) fit: hit tokens / best possible (hps)", get("fit", ("hits", "frac")), ">= 0.99", 0.99, True),
            ("stress: output tok/s hps / direct", get("stress", ("direct", "tok_s")), ">= 0.99", 0.99, True),
            ("stress, tenancy on: output tok/s / direct", all_ratios.get("tenancy", {}).get(("stress", "on/direct", "tok_s"), []),
             ">= 0.99", 0.99, True),
            ("stand-ins: chunks/s 2 workers / 1", [r["ratio_2_over_1"] for r in workers_results(rows_in or [])
                                                    if r.get("ratio_2_over_1")], ">= 1.8", 1.8, True)]
    out = ["| target | measured: mean (range) | goal | met (every round / on the mean) |", "|---|---|---|---|"]
    for name, vals, goal, bound, _ in rows:
        if not vals:
            out.append(f"| {name} | not measured | {goal} | - |")
            continue
        every, mean = all(v >= bound for v in vals), statistics.mean(vals) >= bound
        out.append(f"| {name} | {ratio_stats(vals)} | {goal} | {'yes' if every else 'no'} / {'yes' if mean else 'no'} |")
    return out + [""]


def workers_results(rows: list[dict]) -> list[dict]:
    res = [r.get("result") or {} for r in rows if r.get("phase") == "workers"]
    return [r for r in res if r.get("runs")]


def workers_table(rows: list[dict]) -> list[str]:
    res = workers_results(rows)
    if not res:
        return []
    out = ["### chunks/s through the data plane by worker count (CPU stand-ins)", ""]
    for r in res:
        out += [f"{r.get('cpus')} CPUs; {r.get('standins')} stand-ins, {r.get('clients')} client processes, "
                f"{r.get('concurrency')} streams of {r.get('tokens')} chunks, {r.get('seconds')} s windows, "
                f"policy {r.get('policy')}; --workers in the data plane: {r.get('workers_flag')}", "",
                "| run | workers | chunks/s | failed | cores: data plane / stand-ins / clients |", "|---|---|---|---|---|"]
        for x in r["runs"]:
            cores = x.get("cores") or {}
            out.append(f"| {x.get('run')} | {x.get('workers')} | {fmt(x.get('chunks_s'))} | {fmt(x.get('failed'))} | "
                       f"{cores.get('dataplane', '-')} / {cores.get('standins', '-')} / {cores.get('clients', '-')}"
                       f"{' | ' + x['error'] if x.get('error') else ''} |")
        out += ["", f"2 workers / 1 (best of each): **{r.get('ratio_2_over_1')}** (target >= 1.8)", ""]
    return out


def main() -> int:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    rows = load(sys.argv[1])
    only_targets = "--targets" in sys.argv[2:]
    all_ratios, body = {}, []
    for wl in WORKLOADS:
        lines, ratios = workload_tables(rows, wl)
        body += lines
        all_ratios[wl] = ratios
    ten_lines, all_ratios["tenancy"] = tenancy_tables(rows)
    body += ten_lines
    reps = [r for r in rows if r.get("phase") == "rt" and r.get("step") == "replicas"]
    out = ["## Targets", ""] + targets(all_ratios, rows)
    if not only_targets:
        if reps:
            out += ["Replicas (each call): " + "; ".join(
                f"{r.get('call')}: KV {fmt((r.get('r1') or {}).get('kv_cache_tokens'), 0)} tokens, compile cache "
                f"{(r.get('r1') or {}).get('compile_cache')}/{(r.get('r2') or {}).get('compile_cache')}" for r in reps), ""]
        out += ["## Runs", ""] + body + workers_table(rows)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
