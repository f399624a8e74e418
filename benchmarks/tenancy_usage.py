"""The usage record against what vLLM counted: every request's tokens once, streamed or not, across streams
that moved to another replica; then what a kill -9 of a data-plane worker loses.

    flock /tmp/hpcserve-heavy.lock .venv/bin/python benchmarks/tenancy_usage.py [--requests 10000]
        [--concurrency 16] [--handover-every-s 10] [--kill-requests 2000] [--json F]

Two vLLM CPU engines (the builtin tiny model, one core each) behind a data plane of two workers with tenancy
on (an SQLite store, ten users' keys). Phase "count": --requests requests from --concurrency clients, a
quarter each of completions and chats, streamed and not (streams ask for stream_options.include_usage),
max_tokens 4 to 24; every --handover-every-s one engine is handed over (its streams move to the other, as a
drain does) and added back, so that streams migrate. The client keeps each answer's usage (the whole
answer's, or the stream's usage chunk: vLLM's own; for a stream that moved, the data plane's sum of the
original prompt and every token the client got). Then the rows written are compared with it: requests,
prompt and completion tokens per user, and migrated streams against the data plane's migration log.
Phase "kill": --kill-requests more, and half-way one data-plane worker is killed with SIGKILL; the rows
missing afterwards (answers the clients got without a row) against the bound the docs state (what that
worker answered in its last usage_flush_s + 0.5 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import aiohttp
import psutil
from router import KEY, start_engines
from tenancy_bench import finish, workspace

from hpcserve.core.net import free_loopback_port as free_port
from hpcserve.endpoint.control.plane_client import Router
from hpcserve.tenancy.keyring import add_key
from hpcserve.tenancy.store import open_store

USERS = 10
FLUSH_S = 1.0


async def one(session: aiohttp.ClientSession, url: str, key: str, index: int, rng: random.Random,
              answered: list) -> None:
    chat, streamed = index % 4 in (2, 3), index % 2 == 1
    body: dict = {"model": "tiny", "max_tokens": rng.randint(4, 24), "temperature": 0, "stream": streamed}
    if chat:
        body["messages"] = [{"role": "user", "content": f"usage {index}: tell me something"}]
    else:
        body["prompt"] = f"usage record request {index} " * rng.randint(1, 4)
    if streamed:
        body["stream_options"] = {"include_usage": True}
    route = "chat/completions" if chat else "completions"
    usage = None
    try:
        async with session.post(f"{url}/v1/{route}", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            if streamed:
                async for line in r.content:
                    if line.startswith(b"data: {") and b'"usage":{' in line:
                        usage = json.loads(line[6:])["usage"]
            else:
                usage = (await r.json()).get("usage") if r.status == 200 else None
            ok = r.status == 200
    except (aiohttp.ClientError, ValueError):
        ok = False
    answered.append((key, ok and usage is not None, usage, time.time()))


async def load(url: str, keys: list[str], requests: int, concurrency: int, during=None) -> list:
    answered: list = []
    counter = iter(range(requests))
    rng = random.Random(11)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), trust_env=False,
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def worker() -> None:
            for index in counter:
                await one(session, url, keys[index % len(keys)], index, rng, answered)

        side = asyncio.create_task(during(answered)) if during else None
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        if side:
            side.cancel()
    return answered


def totals(answered: list, users: dict[str, str]) -> dict:
    out: dict = {}
    for key, ok, usage, _ in answered:
        if ok:
            t = out.setdefault(users[key], Counter())
            t["requests"] += 1
            t["prompt_tokens"] += usage["prompt_tokens"]
            t["completion_tokens"] += usage.get("completion_tokens") or 0
    return out


def row_totals(rows) -> dict:
    out: dict = {}
    for row in rows:
        t = out.setdefault(row.user, Counter())
        t["requests"] += 1
        t["prompt_tokens"] += row.prompt_tokens or 0
        t["completion_tokens"] += row.completion_tokens or 0
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--handover-every-s", type=float, default=10.0)
    parser.add_argument("--kill-requests", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with workspace("hpcserve-usage-bench-") as here:
        engines, urls = start_engines(here.folder)
        here.processes += engines
        key_file = here.key_file(KEY)
        database = here.folder / "tenancy.sqlite"
        store = open_store(database)
        users = {add_key(store, f"user{i}")[0]: f"user{i}" for i in range(USERS)}
        settings = here.tenancy(database, FLUSH_S)
        router = Router("127.0.0.1", free_port(), key_file, here.folder / "plane.log", model="tiny", workers=2,
                        admin_socket=here.folder / "plane" / "admin.sock", options=["--tenancy", str(settings)])
        here.routers.append(router)
        router.start(urls)
        time.sleep(1.5)  # the keys loaded by both workers
        keys = list(users)

        async def hand_over(_answered) -> None:
            turn = 0
            while True:
                await asyncio.sleep(args.handover_every_s)
                url = urls[turn % 2]
                await asyncio.to_thread(router.remove, url, 0, True)  # its open streams move now
                await asyncio.to_thread(router.add, url)
                turn += 1

        started = time.time()
        answered = asyncio.run(load(router.url, keys, args.requests, args.concurrency, hand_over))
        wall = time.time() - started
        time.sleep(FLUSH_S + 1.5)
        rows = store.rows(started - 1)
        migrations = [m for m in router.migrations(started - 1) if m.get("to")]
        count = {"requests": len(answered), "answered": sum(ok for _, ok, _, _ in answered),
                 "rows": len(rows), "seconds": round(wall, 1), "req_per_s": round(len(answered) / wall, 1),
                 "migrated_rows": sum(r.migrated for r in rows), "migrations_logged": len(migrations),
                 "client_totals": totals(answered, users), "row_totals": row_totals(rows)}
        count["equal"] = count["client_totals"] == count["row_totals"]
        print(json.dumps({"count": {k: v for k, v in count.items() if not k.endswith("totals")} |
                          {"equal": count["equal"]}}), flush=True)

        workers = psutil.Process(router.pid).children()

        async def kill_one(answered) -> None:
            while len(answered) < args.kill_requests // 2:
                await asyncio.sleep(0.05)
            kill["at"], kill["answered_before"] = time.time(), len(answered)
            os.kill(workers[0].pid, signal.SIGKILL)

        kill: dict = {}
        started = time.time()
        answered = asyncio.run(load(router.url, keys, args.kill_requests, args.concurrency, kill_one))
        time.sleep(FLUSH_S + 1.5)
        rows = store.rows(started - 0.5)
        got = sum(ok for _, ok, _, _ in answered)
        window = [a for a in answered if a[1] and kill["at"] - FLUSH_S - 0.5 <= a[3] <= kill["at"]]
        killed = {"requests": len(answered), "answered": got, "rows": len(rows), "missing_rows": got - len(rows),
                  "bound_answered_in_the_last_flush_window_both_workers": len(window)}
        print(json.dumps({"kill": killed}), flush=True)
        store.close()
        finish({"count": count, "kill": killed}, args)
    return 0




if __name__ == "__main__":
    raise SystemExit(main())
