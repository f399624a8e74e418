"""The client of swap_device.sh: load on one model of a swap deployment, then the demand moves to the other, and
back; what each request got. Run against `hpcserve up` of a config with `swap` (two models on one GPU).

    python3 swap_client.py URL --models A B [--streams 8] [--load-s 15] [--prompt-words 256] [--tokens 256]
                                             [--json F]

The key comes from $HPCSERVE_API_KEY. Phases, one after another:
    load A      --streams closed-loop streams on A for --load-s (A awake, B asleep at the start)
    swap to B   A's client stops sending: the streams in flight finish; at that moment one streamed request for
                B is sent, timed to its first token (the swap: A's streams end, A sleeps, B wakes, B answers);
                then the same closed loop on B for --load-s
    swap to A   the same, back
    burst       16 non-streamed requests, the two models alternating, all at once (each waits for its model)
Every request: HTTP status, whether it ended complete (finish_reason length, --tokens tokens), TTFT. The
figures: for each swap, the first token of the woken model from the swap's start; the streams in flight that
did not complete (target 0); failed requests over the whole run (target 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import aiohttp


async def stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str, tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent, first, finish, completion, status, error = time.perf_counter(), None, None, 0, 0, ""
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            status = response.status
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices") or []:
                    if first is None and choice.get("text"):
                        first = time.perf_counter()
                    finish = choice.get("finish_reason") or finish
                if event.get("usage"):
                    completion = event["usage"]["completion_tokens"]
            if status != 200:
                error = (await response.text())[:300]
    except aiohttp.ClientError as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    done = time.perf_counter()
    return {"model": model, "status": status, "sent": sent, "ttft": None if first is None else first - sent,
            "s": done - sent, "finish": finish, "tokens": completion,
            "complete": status == 200 and finish in (None, "length") and completion == tokens, "error": error}


async def whole(session: aiohttp.ClientSession, url: str, model: str, prompt: str, tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    sent, status, error, completion = time.perf_counter(), 0, "", 0
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            status = response.status
            answer = await response.json(content_type=None)
            completion = (answer.get("usage") or {}).get("completion_tokens", 0)
            if status != 200:
                error = json.dumps(answer)[:300]
    except (aiohttp.ClientError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    return {"model": model, "status": status, "s": time.perf_counter() - sent, "tokens": completion,
            "complete": status == 200 and completion == tokens, "error": error}


def prompt_of(words: int, rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(3, 9999)}" for _ in range(words))


async def closed_loop(session, url, model, args, rng, stop: asyncio.Event, records: list) -> None:
    async def one_stream() -> None:
        while not stop.is_set():
            records.append(await stream(session, url, model, prompt_of(args.prompt_words, rng), args.tokens))
    await asyncio.gather(*(one_stream() for _ in range(args.streams)))


async def models(session, url) -> dict:
    async with session.get(f"{url}/v1/models") as response:
        return {m["id"]: m.get("state") for m in (await response.json())["data"]}


def summary(records: list[dict], seconds: float) -> dict:
    ttfts = sorted(r["ttft"] for r in records if r.get("ttft") is not None)
    return {"requests": len(records), "complete": sum(r["complete"] for r in records),
            "not_complete": [r for r in records if not r["complete"]][:5],
            "tokens_per_s": round(sum(r["tokens"] for r in records) / seconds, 1),
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1) if ttfts else None}


async def load_then_swap(session, url, here: str, there: str, args, rng) -> dict:
    """Load on `here` for load_s; then its client stops and one request for `there` is sent at once."""
    stop, records = asyncio.Event(), []
    started = time.perf_counter()
    loop = asyncio.create_task(closed_loop(session, url, here, args, rng, stop, records))
    await asyncio.sleep(args.load_s)  # the load's length, not a wait for an event
    stop.set()
    swap_started = time.perf_counter()
    in_flight_at_swap = args.streams
    first = asyncio.create_task(stream(session, url, there, prompt_of(args.prompt_words, rng), args.tokens))
    await loop
    load_s = time.perf_counter() - started
    woken = await first
    return {"load": here, "load_phase": summary(records, load_s), "in_flight_at_swap": in_flight_at_swap,
            "in_flight_completed": sum(r["complete"] for r in records if r["sent"] < swap_started
                                       and r["sent"] + r["s"] >= swap_started),
            "woken": there, "woken_first_request": woken,
            "woken_first_token_from_swap_s": None if woken["ttft"] is None else round(woken["ttft"], 3),
            "load_streams_ended_after_swap_s": round(max(r["sent"] + r["s"] for r in records) - swap_started, 3)}


async def main(args: argparse.Namespace) -> dict:
    rng = random.Random(7)
    key = os.environ["HPCSERVE_API_KEY"]
    timeout = aiohttp.ClientTimeout(total=600)
    result: dict = {"args": vars(args) | {"json": str(args.json)}}
    a, b = args.models
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        result["models_at_start"] = await models(session, args.url)
        result["swap_to_b"] = await load_then_swap(session, args.url, a, b, args, rng)
        result["models_after_swap_to_b"] = await models(session, args.url)
        result["swap_to_a"] = await load_then_swap(session, args.url, b, a, args, rng)
        result["models_after_swap_to_a"] = await models(session, args.url)
        burst = await asyncio.gather(*(whole(session, args.url, (a, b)[i % 2], prompt_of(64, rng), 64)
                                       for i in range(16)))
        result["burst"] = {"complete": sum(r["complete"] for r in burst), "requests": len(burst),
                           "slowest_s": round(max(r["s"] for r in burst), 2),
                           "not_complete": [r for r in burst if not r["complete"]][:5]}
        result["models_at_end"] = await models(session, args.url)
    phases = [result["swap_to_b"], result["swap_to_a"]]
    result["requests"] = sum(p["load_phase"]["requests"] + 1 for p in phases) + result["burst"]["requests"]
    result["failed_requests"] = (sum(p["load_phase"]["requests"] - p["load_phase"]["complete"] for p in phases)
                                 + sum(not p["woken_first_request"]["complete"] for p in phases)
                                 + result["burst"]["requests"] - result["burst"]["complete"])
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("--models", nargs=2, required=True)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--load-s", type=float, default=15.0)
    parser.add_argument("--prompt-words", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    outcome = asyncio.run(main(args))
    text = json.dumps(outcome, indent=1, default=str)
    if args.json:
        args.json.write_text(text)
    for phase in ("swap_to_b", "swap_to_a"):
        p = outcome[phase]
        print(f"{phase}: load on {p['load']} {p['load_phase']['tokens_per_s']} tok/s, TTFT p50 "
              f"{p['load_phase']['ttft_p50_ms']} ms, {p['load_phase']['complete']}/{p['load_phase']['requests']} "
              f"complete; {p['woken']}'s first token {p['woken_first_token_from_swap_s']} s after the swap began; "
              f"in flight at the swap completed {p['in_flight_completed']}")
    print(f"burst: {outcome['burst']['complete']}/{outcome['burst']['requests']} complete, slowest "
          f"{outcome['burst']['slowest_s']} s")
    print(f"failed requests: {outcome['failed_requests']} of {outcome['requests']}")
    print("models:", outcome["models_at_start"], "->", outcome["models_after_swap_to_b"], "->",
          outcome["models_after_swap_to_a"])
