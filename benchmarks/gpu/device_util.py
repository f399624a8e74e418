"""Small helpers for the device scripts (startup_device.sh, routing_device.sh): JSON records, vLLM log stages,
/metrics, the loader choice.

usage: device_util.py record FILE key=value...      append one JSON line (values: JSON if they parse, else text)
       device_util.py logstats LOG                  JSON: what vLLM's log says (weights, compile cache, KV cache)
       device_util.py metrics URL OUT.json          snapshot of a replica's /metrics (counters summed over labels)
       device_util.py mdiff B1 A1 [B2 A2 ...]       JSON: counters' increase per replica (before/after pairs) and
                                                 summed, prefix-cache hit rate (hits / queries, in tokens)
       device_util.py rmetrics FILE                 JSON: vllm-router's own counters from a saved /metrics page (cache_aware's
                                                 prefix decisions: prefix_hit / prefix_miss / missing_tokens / ...)
       device_util.py vbsum FILE                    `vllm bench serve --save-result` JSON in this client's summary keys
       device_util.py tree PID                      PID's descendants (to stop a server and its engine by id)
       device_util.py best MICRO.jsonl              the fastest working non-default loader as `name|serve args`
       device_util.py table RESULTS.jsonl           the results so far as short text tables
"""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from pathlib import Path

LOG_PATTERNS = {
    "weights_s": r"Loading weights took ([\d.]+) seconds",
    "model_load_gib": r"Model loading took ([\d.]+) GiB",
    "model_load_s": r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds",
    "dynamo_s": r"Dynamo bytecode transform time: ([\d.]+) s",
    "compile_total_s": r"torch\.compile (?:and initial profiling/warmup run together )?took ([\d.]+) s in total",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)",
    "kv_cache_gib": r"Available KV cache memory: ([\d.]+) GiB",
    "kv_cache_tokens": r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens",
}
HIT = ("Directly load AOT compilation", "Directly load the compiled graph")
MISS = ("Compiling a graph for compile range",)

METRICS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total",
           "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
           "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
           "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total")

# micro variant -> (serve name, extra `vllm serve` arguments)
SERVE_ARGS = {
    "runai": ("runai_streamer", "--load-format runai_streamer"),
    "fastsafetensors": ("fastsafetensors", "--load-format fastsafetensors"),
    "instanttensor": ("instanttensor", "--load-format instanttensor"),
    "st_prefetch": ("prefetch", "--safetensors-load-strategy prefetch"),
    "st_mt8": ("multithread8", "--model-loader-extra-config {\"enable_multithread_load\":true,\"num_threads\":8}"),
    "st_eager": ("eager", "--safetensors-load-strategy eager"),
}


def parse_value(v: str):
    try:
        return json.loads(v)
    except ValueError:
        return v


def record(path: str, pairs: list[str]) -> None:
    rec = {}
    for p in pairs:
        k, _, v = p.partition("=")
        rec[k] = parse_value(v)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def logstats(path: str, patterns: dict[str, str] = LOG_PATTERNS) -> dict:
    """A vLLM server log's figures (the last match of each pattern) and whether its compile cache hit."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return {"log": "missing"}
    out: dict = {}
    for key, pat in patterns.items():
        m = re.findall(pat, text)
        if m:
            out[key] = float(m[-1].replace(",", ""))
    hit, miss = any(s in text for s in HIT), any(s in text for s in MISS)
    out["compile_cache"] = "miss" if miss else "hit" if hit else "unknown"
    errs = [ln for ln in text.splitlines() if re.search(r"Error|Traceback|ERROR", ln)]
    if errs:
        out["first_error"] = errs[0][-300:]
    return out


def metrics(url: str, out: str) -> dict:
    snap: dict[str, float] = {}
    try:
        text = urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10).read().decode()
    except OSError as e:
        snap = {"error": str(e)}
    else:
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            m = re.match(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+\d.eE]+|NaN)$", line.strip())
            if m and m.group(1) in METRICS:
                snap[m.group(1)] = snap.get(m.group(1), 0.0) + float(m.group(3))
    Path(out).write_text(json.dumps(snap))
    return snap


def _rates(d: dict) -> dict:
    q, h = d.get("prefix_cache_queries", 0), d.get("prefix_cache_hits", 0)
    d["hit_rate"] = round(h / q, 4) if q else None
    n = d.get("time_to_first_token_seconds_count", 0)
    d["server_ttft_mean_ms"] = round(1e3 * d.get("time_to_first_token_seconds_sum", 0) / n, 1) if n else None
    return d


def mdiff(paths: list[str]) -> dict:
    out: dict = {"replicas": []}
    total: dict[str, float] = {}
    for before, after in zip(paths[0::2], paths[1::2]):
        a, b = json.loads(Path(before).read_text()), json.loads(Path(after).read_text())
        d = {k.replace("vllm:", "").replace("_total", ""): round(b.get(k, 0) - a.get(k, 0), 3)
             for k in METRICS if k in b}
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
        out["replicas"].append(_rates(d))
    out.update(_rates(total))
    return out


def rmetrics(path: str) -> dict:
    """vllm-router 0.1.17 counters. Its cache_aware routes on token ids that it gets from each worker's
    /v1/completions/render; when that preparation fails it counts outcome="missing_tokens" and falls back
    to the least-loaded worker (no affinity)."""
    out: dict = {}
    try:
        text = Path(path).read_text()
    except OSError:
        return {"error": "no router metrics"}
    for line in text.splitlines():
        m = re.match(r"(vllm_router_[a-z_]+)(\{[^}]*\})?\s+([-+\d.eE]+)$", line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm_router_prefix_routing_decisions_total":
            k = re.search(r'outcome="([^"]+)"', labels)
            out.setdefault("prefix_decisions", {})[k.group(1) if k else "?"] = value
        elif name in ("vllm_router_load_balancing_events_total", "vllm_router_cache_hits_total",
                      "vllm_router_cache_misses_total"):
            out[name.replace("vllm_router_", "")] = out.get(name.replace("vllm_router_", ""), 0) + value
        elif name == "vllm_router_policy_decisions_total":
            w = re.search(r'worker="([^"]+)"', labels)
            out.setdefault("decisions_by_worker", {})[w.group(1)[-4:] if w else "?"] = value
    return out


def vbsum(path: str) -> dict:
    try:
        b = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {"error": "no vllm bench result"}
    keys = {"ok": "completed", "failed": "failed", "duration_s": "duration", "req_s": "request_throughput",
            "output_tok_s": "output_throughput", "ttft_mean_ms": "mean_ttft_ms", "ttft_p50_ms": "median_ttft_ms",
            "ttft_p90_ms": "p90_ttft_ms", "ttft_p99_ms": "p99_ttft_ms", "tpot_mean_ms": "mean_tpot_ms",
            "e2e_p50_ms": "median_e2el_ms", "prompt_tokens": "total_input_tokens"}
    return {k: (round(b[v], 3) if isinstance(b.get(v), float) else b.get(v)) for k, v in keys.items()}


def tree(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def best(path: str) -> str:
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    ok = [r for r in rows if r.get("phase") == "micro" and r.get("ok") and r.get("variant") in SERVE_ARGS]
    if not ok:
        return "runai_streamer|--load-format runai_streamer"
    r = min(ok, key=lambda r: r["seconds"])
    name, args = SERVE_ARGS[r["variant"]]
    return f"{name}|{args}"


def table(path: str) -> None:
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    for r in rows:
        if r.get("phase") == "gen":
            print(f"gen {r.get('step')}: {json.dumps(r.get('result'))[:240]}")
    micro = [r for r in rows if r.get("phase") == "micro"]
    if micro:
        print("loader micro (vLLM 0.26 iterators, 16.06 GB, to GPU)   variant | ok | s | GB/s | copy s | error")
        for r in micro:
            print(f"  {r.get('variant')} | {r.get('ok')} | {r.get('seconds')} | {r.get('gb_s')} | {r.get('copy_s', '')}"
                  f" | {(r.get('error') or '')[:90]}")
    ready = [r for r in rows if r.get("phase") == "ready"]
    if ready:
        print("vllm serve time to ready   case | ok | ready s | weights s | compile cache | compile s | init engine s")
        for r in ready:
            ls = r.get("log", {}) or {}
            print(f"  {r.get('case')} ({r.get('loader')}) | {r.get('ok')} | {r.get('ready_s')} | {ls.get('model_load_s')} | "
                  f"{ls.get('compile_cache')} | {ls.get('compile_total_s')} | {ls.get('init_engine_s')}")
    routing = [r for r in rows if r.get("phase") == "routing" and r.get("workload")]
    if routing:
        print("routing   workload/policy [rate] | hit rate | ttft p50/p90/p99 ms | req/s | out tok/s | failed | max in flight"
              " | per-replica requests | router prefix decisions")
        for r in routing:
            s, m = r.get("client", {}) or {}, r.get("metrics", {}) or {}
            split = [x.get("request_success") for x in m.get("replicas", [])]
            rate = f" @{r['rate']}" if r.get("rate") not in (None, "closed") else ""
            print(f"  {r.get('workload')}/{r.get('policy')}{rate} | {m.get('hit_rate')} | {s.get('ttft_p50_ms')}/"
                  f"{s.get('ttft_p90_ms')}/{s.get('ttft_p99_ms')} | {s.get('req_s')} | {s.get('output_tok_s')} | "
                  f"{s.get('failed')} | {s.get('max_in_flight')} | {split} | "
                  f"{(r.get('router') or {}).get('prefix_decisions')}")


def main() -> None:
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "record":
        record(args[0], args[1:])
    elif cmd == "logstats":
        print(json.dumps(logstats(args[0])))
    elif cmd == "metrics":
        print(json.dumps(metrics(args[0], args[1])))
    elif cmd == "mdiff":
        print(json.dumps(mdiff(args)))
    elif cmd == "vbsum":
        print(json.dumps(vbsum(args[0])))
    elif cmd == "rmetrics":
        print(json.dumps(rmetrics(args[0])))
    elif cmd == "tree":
        print(" ".join(map(str, tree(int(args[0])))))
    elif cmd == "best":
        print(best(args[0]))
    elif cmd == "table":
        table(args[0])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
