"""What tenancy adds to a request, counted in instructions (callgrind): deterministic where the CPU-time
ratios of tenancy_overhead.py move by 0.1 between runs of the same code.

    .venv/bin/python benchmarks/tenancy_instructions.py [--requests 600] [--clients 8] [--tokens 16]
        [--poll-every 300] [--modes direct,off,on] [--kinds plain,streamed] [--without PART,...] [--json F]

For each mode (the client straight to the stand-ins / tenancy off / on) and kind (whole answers / streams), one process under
`valgrind --tool=callgrind --instr-atstart=no` serves --requests requests of --clients clients in flight:
client (aiohttp), data plane (DataPlane on its client port, as serve() runs it) and two stand-in engines
(hpcserve.testing.standin, --tokens tokens, no delay) on one uvloop. Instructions are counted only over the
measured requests (after a warm-up of as many). With tenancy on: a real SQLite store with 100 users' keys (the
limits of tenancy_overhead.py), and the tenancy thread's work (TenantView.poll: the rows written, the counts
read) done in line every --poll-every requests (the thread's poll at about the rate of the real benchmark) and
counted apart. "direct" sends the same requests straight to the stand-ins (in turn), without the data plane: off -
direct is the data plane's own count, the denominator of tenancy_overhead.py's CPU ratio, here deterministic.
Prints per request: the event loop's instructions, the poll's, on - off, and the data plane's own count off and on
(plane_off, plane_on = plane_off + on - off) with their ratio (plane_ratio). The same code
counts within about 0.3 % between runs (string hashes fixed: PYTHONHASHSEED=0).
--without leaves parts of tenancy out of the "on" mode, to count what each costs (on - on --without P): fair
(the admission's fair share), limits (TenantView.admit: nothing counted), usage (a whole answer's usage not read),
row (no usage row: nothing for the meter, the counters or the thread to do), identify (every request its key's
tenant without a look: no digest, no check).
Needs valgrind, gcc and valgrind's headers (callgrind.h), for the start / stop of the count.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = "HPCSERVE_CALLGRIND_CHILD"  # set in the process that valgrind runs: it serves and counts
KEY = "tenancy-instructions-key"
PROMPT = "The quick brown fox jumps over the lazy dog and keeps running through the"
TOGGLE_C = """
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
"""


def toggles(folder: Path) -> ctypes.CDLL:
    """callgrind's client requests, callable from Python (a small library built here)."""
    source, library = folder / "cg_toggle.c", folder / "cg_toggle.so"
    source.write_text(TOGGLE_C)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return ctypes.CDLL(str(library))


async def serve_and_count(args: argparse.Namespace, folder: Path, cg: ctypes.CDLL) -> None:
    import aiohttp
    from aiohttp import web

    from hpcserve.core.net import unix_socket_path
    from hpcserve.endpoint.dataplane.plane import DataPlane
    from hpcserve.endpoint.dataplane.server import ClientServer
    from hpcserve.endpoint.dataplane.settings import Settings
    from hpcserve.endpoint.protocol import BackendSpec
    from hpcserve.tenancy.keyring import add_key
    from hpcserve.tenancy.records import Limits
    from hpcserve.tenancy.store import open_store
    from hpcserve.tenancy.view import TenantView
    from hpcserve.testing.standin import make_app

    runners = []

    async def site(runner: web.BaseRunner) -> str:
        await runner.setup()
        runners.append(runner)
        tcp = web.TCPSite(runner, "127.0.0.1", 0)
        await tcp.start()
        return f"http://127.0.0.1:{tcp._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    engines = [await site(web.AppRunner(make_app(name, tokens=args.tokens, api_key=KEY), access_log=None))
               for name in ("a", "b")]
    tenants, keys = None, [KEY]
    if args.mode == "on":
        database = folder / "tenancy.sqlite"
        store = open_store(database)
        limits = Limits(requests_per_minute=10**7, tokens_per_minute=10**9, tokens_per_day=10**12)
        keys = [add_key(store, f"user{i:03d}", project=f"project{i % 10}", limits=limits)[0] for i in range(100)]
        store.close()
        tenants = TenantView(lambda: open_store(database), KEY, Limits(), flush_s=0.0)
    settings = Settings("127.0.0.1", 0, None, unix_socket_path(folder / "admin.sock"), model="stub")
    plane = DataPlane(settings, KEY, tenants)
    without(plane, set(filter(None, args.without.split(","))))
    await plane.open()
    plane.rooms.own.pool.update([BackendSpec(url) for url in engines])
    plane.rooms.own.wake()
    store = tenants.poll(None) if tenants is not None else None  # the keys, as the thread reads them first
    url = await site(web.ServerRunner(ClientServer(plane), handle_signals=False))
    stream = args.kind == "streamed"
    sent = 0

    async def run(session: aiohttp.ClientSession, count: int) -> None:
        nonlocal sent
        left = count

        async def client(index: int) -> None:
            nonlocal left, sent
            while left > 0:
                left -= 1
                sent += 1
                body = {"model": "stub", "prompt": f"{PROMPT} {index} {sent}", "max_tokens": args.tokens,
                        "stream": stream}
                headers = {"Authorization": f"Bearer {keys[(index * 7919 + sent) % len(keys)]}"}
                target = engines[sent % 2] if args.mode == "direct" else url
                async with session.post(f"{target}/v1/completions", json=body, headers=headers) as answer:
                    await answer.read()
                    assert answer.status == 200, answer.status

        await asyncio.gather(*(client(i) for i in range(args.clients)))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.clients), trust_env=False,
                                     auto_decompress=False) as session:
        await run(session, args.requests)  # warm-up, not counted
        if tenants is not None:
            store = tenants.poll(store)
        # What is alive now is left out of the collector's rounds (both modes alike): a full round over the
        # imports' objects, whenever it falls into the counted requests, moved a mode's count by 10k a request.
        gc.collect()
        gc.freeze()
        done = 0
        while done < args.requests:
            batch = min(args.poll_every, args.requests - done)
            cg.cg_start()
            await run(session, batch)
            cg.cg_dump(b"loop")
            if tenants is not None:
                store = tenants.poll(store)
                cg.cg_dump(b"poll")
            cg.cg_stop()
            done += batch
    if tenants is not None:
        tenants.poll(store, stopping=True)
    await plane.close()
    for runner in runners:
        await runner.cleanup()


PARTS = ("fair", "limits", "usage", "row", "identify")


def without(plane, parts: set[str]) -> None:
    """The parts of tenancy (PARTS) left out of this data plane (its own functions replaced by no-ops)."""
    from hpcserve.endpoint.dataplane import tenants as visits

    unknown = parts - set(PARTS)
    if unknown:
        raise SystemExit(f"--without: unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    view = plane.tenants
    if view is None:
        return
    if "fair" in parts:
        plane.rooms.own.admission.fair = None
    if "limits" in parts:
        view.admit = lambda tenant, data, now: None
    if "usage" in parts:
        def first_byte_only(self, body):
            self.first_byte = time.monotonic()
        visits.Visit.whole_answer = first_byte_only
    if "row" in parts:
        view.ended = lambda row: None
        plane.stats.used = lambda project, prompt, completion: None
    if "identify" in parts:
        check = view.identify
        known: dict = {}

        def identify(authorization, now):
            tenant = known.get(authorization)
            if tenant is None:
                tenant = known[authorization] = check(authorization, now)
            return tenant
        view.identify = identify


def child(args: argparse.Namespace) -> None:
    import uvloop

    folder = Path(os.environ[CHILD])
    uvloop.run(serve_and_count(args, folder, toggles(folder)))


def count(args: argparse.Namespace, mode: str, kind: str) -> dict[str, float]:
    """Instructions per request of one mode and kind: {"loop": ..., "poll": ...}."""
    with tempfile.TemporaryDirectory(prefix="hpcserve-callgrind-") as folder:
        out = Path(folder) / "callgrind.out"
        argv = [sys.executable, __file__, "--mode", mode, "--kind", kind, "--requests", str(args.requests),
                "--clients", str(args.clients), "--tokens", str(args.tokens), "--poll-every", str(args.poll_every),
                "--without", args.without]
        subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p",
                        *argv], check=True, env={**os.environ, CHILD: folder, "PYTHONHASHSEED": "0"},
                       stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        totals = {"loop": 0, "poll": 0}
        for dump in Path(folder).glob("callgrind.out.*"):
            text = dump.read_text(errors="replace")
            trigger = re.search(r"^desc: Trigger: Client Request: (\w+)", text, re.MULTILINE)
            summary = re.search(r"^summary: (\d+)", text, re.MULTILINE)
            if trigger and summary and trigger.group(1) in totals:
                totals[trigger.group(1)] += int(summary.group(1))
        return {part: round(total / args.requests) for part, total in totals.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--poll-every", type=int, default=300)
    parser.add_argument("--modes", default="direct,off,on")
    parser.add_argument("--kinds", default="plain,streamed")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--without", default="", help=f"parts left out of 'on': {', '.join(PARTS)}")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if os.environ.get(CHILD):
        child(args)
        return 0
    results: dict[str, dict] = {}
    for kind in args.kinds.split(","):
        point = results[kind] = {mode: count(args, mode, kind) for mode in args.modes.split(",")}
        if "on" in point and "off" in point:
            point["on_minus_off"] = point["on"]["loop"] + point["on"]["poll"] - point["off"]["loop"]
            if "direct" in point:  # the data plane's own count: what the client and stand-ins take left out
                plane_off = point["off"]["loop"] - point["direct"]["loop"]
                point["plane_off"], point["plane_on"] = plane_off, plane_off + point["on_minus_off"]
                point["plane_ratio"] = round(point["plane_on"] / plane_off, 3)
        print(json.dumps({kind: point}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
