"""A shared-prefix load for a pool of vLLM replicas behind a router, streamed.

usage: prefix_client.py --url URL[,URL2...] --out OUT.json --seed S [--model m] [--concurrency C]
                             [--session-header] [--kv-tokens K [--replicas 2] [--block 16]] [--request-ids]
                             [--keys FILE]
         --mode prefix    --num-prefixes P --prefix-len L --suffix-len X --output-len O --num-requests N
                          [--request-rate R]
         --mode multiturn --sessions S --turns T --user-len U --output-len O [--api completions|chat]

Why not `vllm bench serve --dataset-name prefix_repetition`: it sends every request with its own
`x-request-id` header (vllm/benchmarks/lib/endpoint_request_func.py:145 in the 0.26 wheel), and
vllm-router's consistent_hash policy keys on the first of x-session-id, x-user-id, x-tenant-id,
x-correlation-id, x-request-id, x-trace-id, then the body's user/session fields, then a hash of the whole
body (src/policies/hash_key.rs): under vllm bench, consistent_hash is random routing. This client sends
`x-session-id: <prefix or session id>` (--session-header; every policy gets the same requests, only
consistent_hash reads it) and no x-request-id.

Prompts are strings of the model_folder.py tokenizer's words ('w123 w456 ...', one token each), so their
token lengths are exact and a shared prefix is a shared string prefix (what cache_aware matches on).
- prefix: P random prefixes of L tokens; N requests, N/P per prefix, each prefix + its own X-token
  suffix, in a seeded random order, at most C in flight, O output tokens each (ignore_eos).
  --request-rate R (> 0): open loop instead, the N requests sent at Poisson arrival times of mean rate R
  per second (exponential gaps from their own seeded generator: the same schedule for every policy at one
  seed), whatever is in flight; C still caps what is in flight (give a large C: a cap that binds turns it
  back into a closed loop, and the summary's max_in_flight shows whether it did). TTFT counts from the
  request's scheduled arrival, so a client that falls behind (send_lag) is charged, not hidden.
- multiturn: S conversations of T turns; turn k sends the whole history (earlier prompts and answers)
  plus U new tokens and waits for the answer (O tokens) before the next turn; C conversations at a time.
A few short unrelated warm-up requests go first (not timed, no shared prefix).
--request-ids (prefix mode): each request carries `x-request-id: <OUT's stem>.g<prefix>.i<position>`, which
vLLM takes as its request id; replicas with --enable-log-requests then log which of them each one served
(routing_placement.py reads that). Off by default (vllm-router's consistent_hash would key on it).
--keys FILE: the keys to send (one a line, e.g. users' own keys of a data plane with tenancy on:
tenancy_keys.py writes it): every request, warm-ups included, carries `Authorization: Bearer` with the next key
in turn, so N keys are used alike. Without it, no Authorization header (an open endpoint).
Several URLs (comma-separated): the client itself sends request i to URL i mod n (round robin over the
replicas, no router: the `direct` baseline).
--api chat (multiturn): /v1/chat/completions with the conversation as messages (user, assistant, ...);
the replicas need a chat template that joins the messages' contents with one space each
(routing_device.sh writes it), so turn k's prompt starts with turn k-1's prompt and answer, token for token.
--kv-tokens K: the summary also gives best_hit_tokens, the most prefix-cache hit tokens any router could
get on what was sent (block size --block, --replicas caches of K tokens each; vLLM caches whole blocks):
  prefix    Belady's optimal eviction on one cache of replicas x K tokens (an upper bound for separate
            caches), less the blocks the requests in flight hold of their own; the requests in the order sent.
            When every prefix fits, it is every repeat of a prefix hitting its whole blocks
            (best_hit_tokens_no_eviction, always given). lru_hit_tokens: the same cache evicting the least
            recently used prefix first (its last blocks first), as vLLM's engines do: what a router gets at
            most where the engines choose what to evict (on evict both routers came within 2 % of it).
  multiturn every turn after the first hitting the whole blocks of the previous turn's prompt and answer
            (as the server counted them: usage); an upper bound, reached when nothing is evicted.
Requests go out through hpcserve's load generator (hpcserve.benchmark.loadgen: TTFT, E2E and usage as
`hpcserve bench` reads them); percentiles are hpcserve.benchmark.stats's (linear interpolation).
--timeout bounds a stalled response, --run-timeout the whole run.
Writes OUT.json (config + summary) and OUT.requests.jsonl (one line per request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from collections import OrderedDict
from pathlib import Path

from hpcserve.benchmark.loadgen import (
    LoadShape,
    RequestInput,
    RequestOutput,
    make_session,
    run_load,
    send_request,
)
from hpcserve.benchmark.stats import percentile
from hpcserve.engine.client import Endpoint

WARMUP_REQUESTS, WARMUP_WORDS, WARMUP_TOKENS = 8, 64, 4


def words(rng: random.Random, n: int, vocab: int) -> str:
    return " ".join(f"w{rng.randrange(3, vocab)}" for _ in range(n))


def request(a, prompt: str | list[dict], key: str | None, request_id: str | None = None,
            output_len: int | None = None) -> RequestInput:
    headers = {"x-session-id": key} if (key is not None and a.session_header) else {}
    if a.keys:
        a.keys_sent += 1
        headers["Authorization"] = f"Bearer {a.keys[a.keys_sent % len(a.keys)]}"
    if request_id is not None:
        headers["x-request-id"] = request_id
    return RequestInput(prompt, a.output_len if output_len is None else output_len, headers=headers,
                        temperature=0.0)


def record(a, index: int, output: RequestOutput, late_s: float = 0.0) -> dict:
    """One line of OUT.requests.jsonl. late_s: how long after its scheduled arrival the request went out,
    charged to its TTFT and E2E (open loop)."""
    return {"ok": output.ok, "ttft": None if output.ttft_s is None else output.ttft_s + late_s,
            "e2e": None if output.e2e_s is None else output.e2e_s + late_s, "error": output.error,
            "url": a.endpoints[index % len(a.endpoints)].base_url[-4:], "prompt_tokens": output.prompt_tokens,
            "completion_tokens": output.output_tokens,
            # vLLM fills this only with --enable-prompt-tokens-details on the server
            "cached_tokens": output.cached_tokens}


def most_in_flight(outputs: list[RequestOutput]) -> int:
    """The most requests in flight at once (a failed one counts for an instant). Pure."""
    events = sorted([(o.start_s, 1) for o in outputs] + [(o.start_s + (o.e2e_s or 0.0), -1) for o in outputs],
                    key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


async def warmup(a) -> None:
    rng = random.Random(a.seed + 999_999)
    inputs = [request(a, words(rng, WARMUP_WORDS, a.vocab), None, output_len=WARMUP_TOKENS)
              for _ in range(WARMUP_REQUESTS)]
    await run_load(a.endpoints, inputs, LoadShape(concurrency=WARMUP_REQUESTS), [0.0] * WARMUP_REQUESTS,
                   timeout_s=a.timeout)


async def run_prefix(a, records: list[dict]) -> None:
    rng = random.Random(a.seed)
    prefixes = [words(rng, a.prefix_len, a.vocab) for _ in range(a.num_prefixes)]
    per = a.num_requests // a.num_prefixes
    jobs = [(p, prefixes[p] + " " + words(rng, a.suffix_len, a.vocab)) for p in range(a.num_prefixes)
            for _ in range(per)]
    rng.shuffle(jobs)
    arrivals = [0.0] * len(jobs)
    if a.request_rate > 0:  # Poisson: exponential gaps, the first request at 0
        arng, t = random.Random(a.seed + 7_777_777), 0.0
        for i in range(len(jobs)):
            arrivals[i] = t
            t += arng.expovariate(a.request_rate)
    stem = Path(a.out).stem
    inputs = [request(a, prompt, f"p{p}", f"{stem}.g{p}.i{i}" if a.request_ids else None)
              for i, (p, prompt) in enumerate(jobs)]
    shape = LoadShape(concurrency=a.concurrency, request_rate=a.request_rate or math.inf)
    result = await run_load(a.endpoints, inputs, shape, arrivals, timeout_s=a.run_timeout, request_timeout_s=a.timeout)
    a.sent_order = [(i, jobs[i][0]) for i in result.sent]  # the order the oracle of best_hits replays
    for i, output in zip(result.sent, result.outputs, strict=True):
        lag = output.start_s - arrivals[i] if a.request_rate > 0 else 0.0
        rec = {"i": i, "group": jobs[i][0], "turn": 0, **record(a, i, output, lag)}
        if a.request_rate > 0:
            rec.update(arrival=arrivals[i], send_lag=lag)
        records.append(rec)
    a.max_in_flight = a.concurrency_seen = most_in_flight(result.outputs)
    a.arrival_span_s = round(arrivals[-1], 2) if a.request_rate > 0 and arrivals else None


async def run_multiturn(a, records: list[dict]) -> None:
    rng = random.Random(a.seed)
    users = [[words(rng, a.user_len, a.vocab) for _ in range(a.turns)] for _ in range(a.sessions)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for s in range(a.sessions):
        queue.put_nowait(s)
    sent = 0  # the client's own round robin over several URLs, in the order sent

    async def worker(session) -> None:
        nonlocal sent
        while True:
            try:
                s = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            history, messages = "", []
            for t in range(a.turns):
                if a.api == "chat":
                    messages = messages + [{"role": "user", "content": users[s][t]}]
                    prompt = messages
                else:
                    prompt = (history + " " + users[s][t]).strip()
                index, sent = sent, sent + 1
                output = await send_request(session, a.endpoints[index % len(a.endpoints)],
                                            request(a, prompt, f"s{s}"), True, run_start=0.0)
                answer = output.text.strip()
                records.append({"i": len(records), "group": s, "turn": t, "answer_words": len(answer.split()),
                                **record(a, index, output)})
                if not output.ok:
                    break
                history = prompt + " " + answer if a.api != "chat" else ""
                messages = messages + [{"role": "assistant", "content": answer}]

    async with make_session(LoadShape(concurrency=a.concurrency), a.timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(a.concurrency)))


def belady_hits(sequence: list[int], blocks: int, capacity: int) -> int:
    """Blocks hit by Belady's optimal eviction: requests for groups (sequence), each group's first `blocks`
    blocks shared by all its requests, one cache of `capacity` blocks. A group holds a leading run of its
    blocks; on a request its cached run is hit, then the whole group is cached and blocks are dropped from
    the group used furthest ahead (the requested one too, when that is it). Pure."""
    nxt, last = [0] * len(sequence), {}
    for i in range(len(sequence) - 1, -1, -1):
        nxt[i] = last.get(sequence[i], float("inf"))
        last[sequence[i]] = i
    held: dict[int, int] = {}  # group -> cached leading blocks
    upcoming: dict[int, float] = {}  # group -> index of its next request
    hits, total = 0, 0
    for i, g in enumerate(sequence):
        hits += held.get(g, 0)
        total += blocks - held.get(g, 0)
        held[g] = blocks
        upcoming[g] = nxt[i]
        while total > capacity:
            victim = max(held, key=lambda k: upcoming[k])
            drop = min(held[victim], total - capacity)
            held[victim] -= drop
            total -= drop
            if held[victim] == 0:
                del held[victim]
    return hits


def lru_hits(sequence: list[int], blocks: int, capacity: int) -> int:
    """Blocks hit when one cache of `capacity` blocks evicts the least recently used group first, its last
    blocks first (vLLM frees a request's blocks tail first): as belady_hits, with LRU in place of Belady. Pure."""
    held: OrderedDict[int, int] = OrderedDict()  # group -> cached leading blocks, least recently used first
    hits, total = 0, 0
    for g in sequence:
        cached = held.pop(g, 0)
        hits += cached
        total += blocks - cached
        held[g] = blocks
        while total > capacity:
            victim, kept = next(iter(held.items()))
            drop = min(kept, total - capacity)
            total -= drop
            if kept > drop:
                held[victim] = kept - drop  # stays first: still the least recently used
            else:
                del held[victim]
    return hits


def best_hits(records: list[dict], a) -> dict:
    """The most prefix-cache hit tokens the workload sent allows (see the module's doc)."""
    b = a.block
    if a.mode == "prefix":
        order = [g for _, g in sorted(a.sent_order)]
        shared = a.prefix_len // b  # whole blocks of the shared prefix
        repeats = len(order) - len(set(order))
        own = -(-(a.prefix_len + a.suffix_len + a.output_len) // b) - shared  # a request's blocks of its own
        in_flight = min(a.concurrency, len(order)) if not a.request_rate else a.concurrency_seen
        capacity = max(0, a.replicas * (a.kv_tokens // b) - in_flight * own)
        return {"best_hit_tokens": belady_hits(order, shared, capacity) * b,
                "best_hit_tokens_no_eviction": repeats * shared * b,
                "lru_hit_tokens": lru_hits(order, shared, capacity) * b,
                "best_capacity_blocks": capacity, "best_method": "belady, one cache of replicas x kv_tokens"}
    best, mismatched = 0, 0
    by_group: dict[int, list[dict]] = {}
    for r in records:
        by_group.setdefault(r["group"], []).append(r)
    for turns in by_group.values():
        turns.sort(key=lambda r: r["turn"])
        for prev, cur in zip(turns, turns[1:]):
            if not (prev["ok"] and cur["ok"]) or prev.get("prompt_tokens") is None:
                continue
            answer = min(prev["completion_tokens"] or 0, prev.get("answer_words", 0))
            mismatched += (prev.get("answer_words") != prev["completion_tokens"])
            best += (prev["prompt_tokens"] + answer - 1) // b * b
    return {"best_hit_tokens": best, "best_method": "each turn hits the previous turn's whole blocks",
            "answers_not_one_word_a_token": mismatched}


def summarize(records: list[dict], duration: float, a) -> dict:
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft"] * 1e3 for r in ok]
    e2e = [r["e2e"] * 1e3 for r in ok]
    out_tok = sum(r["completion_tokens"] or 0 for r in ok)
    in_tok = sum(r["prompt_tokens"] or 0 for r in ok)
    tpot = [(r["e2e"] - r["ttft"]) * 1e3 / (r["completion_tokens"] - 1) for r in ok
            if (r["completion_tokens"] or 0) > 1]
    s = {"requests": len(records), "ok": len(ok), "failed": len(records) - len(ok), "duration_s": round(duration, 2),
         "req_s": round(len(ok) / duration, 3), "output_tok_s": round(out_tok / duration, 1),
         "input_tok_s": round(in_tok / duration, 1), "prompt_tokens": in_tok, "completion_tokens": out_tok,
         "ttft_mean_ms": round(statistics.mean(ttft), 1) if ttft else None,
         **{f"ttft_p{q}_ms": (round(percentile(ttft, q), 1) if ttft else None) for q in (50, 90, 99)},
         "e2e_p50_ms": round(percentile(e2e, 50), 1) if e2e else None, "e2e_p99_ms": round(percentile(e2e, 99), 1) if e2e else None,
         "tpot_mean_ms": round(statistics.mean(tpot), 2) if tpot else None,
         "first_errors": [r["error"] for r in records if not r["ok"]][:3]}
    cached = [r for r in ok if r.get("cached_tokens") is not None]
    if cached:  # per request: a hit = most of its prompt came from the prefix cache
        hit = [r["ttft"] * 1e3 for r in cached if r["cached_tokens"] >= 0.5 * (r["prompt_tokens"] or 1)]
        miss = [r["ttft"] * 1e3 for r in cached if r["cached_tokens"] < 0.5 * (r["prompt_tokens"] or 1)]
        s["hit_request_fraction"] = round(len(hit) / len(cached), 4)
        s["ttft_p50_ms_hits"] = round(percentile(hit, 50), 1) if hit else None
        s["ttft_p50_ms_misses"] = round(percentile(miss, 50), 1) if miss else None
    if a.mode == "prefix":
        s["request_rate"] = a.request_rate or None  # offered (None: closed loop at --concurrency)
        s["max_in_flight"] = getattr(a, "max_in_flight", None)
        if a.request_rate > 0:
            lag = [r["send_lag"] * 1e3 for r in records if r.get("send_lag") is not None]
            s["arrival_span_s"] = getattr(a, "arrival_span_s", None)
            s["offered_req_s"] = round((len(records) - 1) / s["arrival_span_s"], 3) if s["arrival_span_s"] else None
            s["send_lag_p99_ms"] = round(percentile(lag, 99), 1) if lag else None
    if a.kv_tokens:
        s.update(best_hits(records, a))
    if len(a.urls) > 1:
        s["requests_by_url"] = {u[-4:]: sum(1 for r in records if r.get("url") == u[-4:]) for u in a.urls}
    if a.mode == "multiturn":
        for t in sorted({r["turn"] for r in ok}):
            v = [r["ttft"] * 1e3 for r in ok if r["turn"] == t]
            s[f"ttft_p50_ms_turn{t + 1}"] = round(percentile(v, 50), 1)
    return s


async def main_async(a) -> None:
    records: list[dict] = []
    await warmup(a)
    t0 = time.perf_counter()
    if a.mode == "prefix":
        await run_prefix(a, records)
    else:
        await run_multiturn(a, records)
    duration = time.perf_counter() - t0
    config = {k: v for k, v in vars(a).items() if k not in ("out", "sent_order", "endpoints", "keys")}
    config["keys"] = len(a.keys)  # how many, never the keys themselves
    summary = summarize(records, duration, a)
    out = Path(a.out)
    out.write_text(json.dumps({"config": config, "summary": summary}, indent=1))
    with out.with_suffix(".requests.jsonl").open("w") as f:
        for r in sorted(records, key=lambda r: r["i"]):
            f.write(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}) + "\n")
    print(json.dumps(summary))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--model", default="m")
    ap.add_argument("--mode", choices=["prefix", "multiturn"], default="prefix")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--session-header", action="store_true")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--timeout", type=float, default=300, help="a stalled response's limit (s)")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-prefixes", type=int, default=200)
    ap.add_argument("--prefix-len", type=int, default=1900)
    ap.add_argument("--suffix-len", type=int, default=100)
    ap.add_argument("--num-requests", type=int, default=800)
    ap.add_argument("--request-rate", type=float, default=0.0,
                    help="prefix mode: open loop, Poisson arrivals at this mean rate (req/s); 0 = closed loop")
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-len", type=int, default=250)
    ap.add_argument("--api", choices=["completions", "chat"], default="completions",
                    help="multiturn: /v1/completions with the history as text, or /v1/chat/completions")
    ap.add_argument("--kv-tokens", type=int, default=0, help="each replica's KV cache (tokens): best_hit_tokens")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--block", type=int, default=16, help="the engines' KV block size (tokens)")
    ap.add_argument("--request-ids", action="store_true", help="prefix mode: x-request-id naming prefix and position")
    ap.add_argument("--keys", type=Path, help="a file of keys, one a line: each request carries the next (Bearer)")
    ap.add_argument("--run-timeout", type=float, default=3600, help="the whole run's deadline (s)")
    a = ap.parse_args()
    a.urls = [u.rstrip("/") for u in a.url.split(",") if u]
    a.endpoints = [Endpoint(u, a.model, None) for u in a.urls]
    a.keys = a.keys.read_text().split() if a.keys else []
    a.keys_sent = 0
    if a.request_rate > 0 and a.mode != "prefix":
        ap.error("--request-rate applies to --mode prefix only")
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
