"""Fair share on real vLLM: user A (a batch job, many requests in flight) and user B (a tenth of A's request rate)
into one full pool, with the data plane's fair share (tenancy on: A's and B's own keys, projects of equal
shares) against first come first served (tenancy off: both send the deployment's key, requests queue in the
engines). Side by side in one run.

    flock /tmp/hpcserve-heavy.lock .venv/bin/python benchmarks/tenancy_fair_share.py [--phase-s 60]
        [--a-in-flight 24] [--b-rate 0] [--tokens 16] [--max-num-seqs 4] [--json F]
        [--engine-cores 0,1] [--rounds 1] [--standin-token-ms MS [--standin-first-ms MS]]

Two vLLM CPU engines (the builtin tiny model, one core each, --max-num-seqs, their capacity told to the data
plane). --b-rate 0: B sends a tenth of A's request rate alone, measured for CALIBRATE_S through the first come
first served data plane first (which also warms the engines). For each mode, three phases of --phase-s: B
alone (an open loop at --b-rate requests/s), A alone (a closed loop of --a-in-flight streams), both; with
--rounds N, B alone once and then N rounds of A alone and both, the modes taking turns in each round, each
figure the median of the rounds' (an engine's speed drifts between phases minutes apart by more than the
targets' margins). Each request is a streamed completion of --tokens tokens
(ignore_eos); with --vary-tokens V each request's length is drawn uniformly within +-V of it (same mean): requests
of one length that start together end together, so that a full pool frees its places in waves. Reported per phase: B's time to first token (p50, p90), and the pool's throughput (completion
tokens/s of both users, counted from the usage chunk), and the engines' occupancy: their running requests
(vLLM's /metrics, read every OCCUPANCY_EVERY_S) over --max-num-seqs, on average; and the tokens the engines
generated per second within the phase by their own counter (vllm:generation_tokens_total, read at the same
times), beside the clients' count, which includes the phase's tail (its last streams end after its time); and the
cores the data plane kept busy (plane_cores: its workers' CPU seconds over the phase's time; near the number of
workers, the data plane set the pace, not the engines). The figures the issue asks
for: B's TTFT p50 with A over B's alone (target <= 1.25) and the pool's throughput with B over A alone's
(target >= 0.97). On two shared cores the engines' speed moves between phases by more than that; the
occupancy ratio (A and B over A alone) says whether places were left empty, whatever the speed. With fair
share, how long B's requests waited in the data plane for a place (its /metrics, hpcserve_project_admission_wait_
seconds of B's project): what of B's TTFT is the admission's, the rest is the engines' (and, here, the shared cores');
and how many of A's streams paused for B (hpcserve_router_stream_pauses). --modes fair,nopause,fcfs adds fair
share without those pauses (tenancy.pause_streams off) to the comparison, and "floor" first come first served
with A one place per engine short of the pool (B's request joins a running batch at once: the least B's time
to first token can be while A runs, whatever the order; its B ratio is the engines' own).
--standin-token-ms: stand-ins (hpcserve.testing.standin) instead of vLLM, each --max-num-seqs places served
first come first served, a request's first token after --standin-first-ms and then one every MS: a pool
shaped like the GPU's (whose throughput follows the places in use), on which the admission's choices show
without an engine's noise; not a measure of an engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families
from router import KEY, start_engines, start_stubs
from tenancy_bench import finish, workspace

from hpcserve.benchmark.summary import percentile
from hpcserve.core.net import free_loopback_port as free_port
from hpcserve.endpoint.control.plane_client import Router
from hpcserve.engine.metrics import engine_load, sample_values
from hpcserve.tenancy.keyring import add_key
from hpcserve.tenancy.store import open_store

# fair share; the same without pausing A's streams; first come first served; and the floor: first come first
# served with A holding one place per engine fewer than there are, so that B's request always joins a running
# batch at once (the best any order of requests could give B while A's streams run: what the engines' batching
# itself adds to B's time to first token)
MODES = ("fair", "nopause", "fcfs", "floor")
CALIBRATE_S = 10.0
B_SHARE = 0.1  # --b-rate 0: B sends a tenth of A's request rate alone (the "A sends 10x B's rate")
B_PROJECT = "pb"
WAITS = "hpcserve_project_admission_wait_seconds"
PAUSES = "hpcserve_router_stream_pauses"
GENERATED = "vllm:generation_tokens_total"  # the engines' own count of tokens made (read with the occupancy)
OCCUPANCY_EVERY_S = 0.25  # /metrics reads per engine: each costs its API server a few ms of a shared core


async def stream(session: aiohttp.ClientSession, url: str, key: str, tokens: int, index: int, record: dict) -> None:
    body = {"model": "tiny", "prompt": f"request {index} of the fair share benchmark", "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent, first = time.perf_counter(), None
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            async for line in r.content:
                if first is None and line.startswith(b"data: {") and b'"text"' in line:
                    first = time.perf_counter()
                if line.startswith(b"data: {") and b'"usage":{' in line:
                    record["tokens"] += json.loads(line[6:])["usage"]["completion_tokens"]
            if r.status != 200 or first is None:
                record["failed"] += 1
                return
    except aiohttp.ClientError:
        record["failed"] += 1
        return
    record["ttft"].append(first - sent)


async def occupancy(session: aiohttp.ClientSession, engines: list[str], until: float, running: list[float],
                    generated: list[tuple[float, float]]) -> None:
    """Each engine's running requests, read from its /metrics every OCCUPANCY_EVERY_S until `until`; and
    at each round where every engine answered, the tokens all of them generated so far (vLLM's counter;
    stand-ins have none) with the time."""
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        tokens: float | None = 0.0
        for engine in engines:
            try:
                async with session.get(f"{engine}/metrics") as r:
                    text = await r.text()
                running.append(engine_load(text).running)
                counted = sample_values(text, (GENERATED,))[GENERATED]
                tokens = tokens + sum(counted) if tokens is not None and counted else None
            except (aiohttp.ClientError, ValueError):
                tokens = None
        if tokens is not None:
            generated.append((loop.time(), tokens))
        await asyncio.sleep(OCCUPANCY_EVERY_S)


class Target(NamedTuple):
    """A mode's data plane: its URL, the keys A and B send, its /metrics text (None: B's waits not told apart)."""

    url: str
    keys: dict[str, str]
    metrics: Callable[[], str] | None = None
    pid: int | None = None  # the data plane's process (its workers are its children)


def plane_cpu_s(pid: int | None) -> float | None:
    """CPU seconds the data plane and its workers have used so far (None: not known)."""
    if pid is None:
        return None
    try:
        process = psutil.Process(pid)
        return sum(sum(p.cpu_times()[:2]) for p in (process, *process.children(recursive=True)))
    except psutil.Error:
        return None


def project_waits(metrics: str, project: str) -> tuple[float, float, float]:
    """(requests that waited in admission, seconds waited in all) of a project, and the streams paused for
    others (all projects'), from the data plane's /metrics."""
    waits, pauses = (0.0, 0.0), 0.0
    for family in text_string_to_metric_families(metrics):
        if family.name == WAITS:
            got = {s.name: s.value for s in family.samples if s.labels.get("project") == project}
            waits = got.get(WAITS + "_count", 0.0), got.get(WAITS + "_sum", 0.0)
        elif family.name == PAUSES:
            pauses = family.samples[0].value
    return (*waits, pauses)


async def phase(target: Target, users: str, args: argparse.Namespace) -> dict:
    """A closed loop for A and/or an open loop (Poisson) for B, for phase_s; what each got."""
    url, keys = target.url, target.keys
    waits_before = project_waits(await asyncio.to_thread(target.metrics), B_PROJECT) if target.metrics else None
    records = {u: {"ttft": [], "tokens": 0, "failed": 0} for u in "AB"}
    running: list[float] = []
    generated: list[tuple[float, float]] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.phase_s
    cpu_before = plane_cpu_s(target.pid)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, trust_env=False,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.perf_counter()
        tasks = []

        def length(rng: random.Random) -> int:
            """A request's output tokens: --tokens, or with --vary-tokens V uniform within +-V of it."""
            spread = int(args.tokens * args.vary_tokens)
            return args.tokens + rng.randint(-spread, spread) if spread else args.tokens

        async def a_worker(worker: int) -> None:
            count, rng = 0, random.Random(worker)
            while loop.time() < deadline:
                count += 1
                await stream(session, url, keys["A"], length(rng), worker * 100000 + count, records["A"])

        async def b_arrivals() -> None:
            count, rng = 0, random.Random(7)
            while loop.time() < deadline:
                count += 1
                tasks.append(asyncio.create_task(stream(session, url, keys["B"], length(rng), count, records["B"])))
                await asyncio.sleep(rng.expovariate(args.b_rate))

        work = ([a_worker(i) for i in range(args.a_in_flight)] if "A" in users else []) + \
               ([b_arrivals()] if "B" in users else []) + [occupancy(session, args.engines, deadline, running, generated)]
        await asyncio.gather(*work)
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
    b = records["B"]["ttft"]
    got = {"b_requests": len(b), "b_ttft_p50_s": percentile(b, 50), "b_ttft_p90_s": percentile(b, 90),
           "b_ttft_mean_s": round(sum(b) / len(b), 4) if b else None,
           "a_requests": len(records["A"]["ttft"]), "failed": records["A"]["failed"] + records["B"]["failed"],
           "tokens_per_s": round((records["A"]["tokens"] + records["B"]["tokens"]) / wall, 1),
           "occupancy": round(sum(running) / len(running) / args.max_num_seqs, 3) if running else None}
    cpu_after = plane_cpu_s(target.pid)
    if cpu_before is not None and cpu_after is not None:  # cores the data plane kept busy: near its workers' count,
        got["plane_cores"] = round((cpu_after - cpu_before) / wall, 2)  # it, not the engines, set the pace
    if len(generated) >= 2 and generated[-1][1] > generated[0][1]:  # the engines' own count, within the phase
        # (no tail of streams ending after it); stand-ins count nothing
        (first_at, first), (last_at, last) = generated[0], generated[-1]
        got["engine_tokens_per_s"] = round((last - first) / (last_at - first_at), 1)
    if waits_before is not None and target.metrics is not None and b:
        count, total, pauses = project_waits(await asyncio.to_thread(target.metrics), B_PROJECT)
        # B's requests that waited for a place, and the mean wait over all of B's (beside b_ttft_mean_s); A's
        # streams that paused for B
        got["b_waited"] = int(count - waits_before[0])
        got["b_wait_mean_s"] = round((total - waits_before[1]) / len(b), 4)
        got["pauses"] = int(pauses - waits_before[2])
    return got


async def calibrate(target: Target, args: argparse.Namespace) -> float:
    """A's request rate alone (requests/s over CALIBRATE_S, the stragglers' tail included)."""
    started = time.perf_counter()
    got = await phase(target, "A", argparse.Namespace(**{**vars(args), "phase_s": CALIBRATE_S}))
    return got["a_requests"] / (time.perf_counter() - started)


def ratios(alone: dict, both: dict, b_alone: dict) -> dict:
    """The targets' figures of one A alone phase and the A and B phase after it."""
    got = {"b_ttft_ratio": round(both["b_ttft_p50_s"] / b_alone["b_ttft_p50_s"], 2),
           "throughput_ratio": round(both["tokens_per_s"] / alone["tokens_per_s"], 3)}
    if both.get("engine_tokens_per_s") and alone.get("engine_tokens_per_s"):
        got["engine_throughput_ratio"] = round(both["engine_tokens_per_s"] / alone["engine_tokens_per_s"], 3)
    if both["occupancy"] and alone["occupancy"]:
        got["occupancy_ratio"] = round(both["occupancy"] / alone["occupancy"], 3)
    return got


async def run(targets: dict[str, Target], args: argparse.Namespace) -> dict:
    """Per mode B alone, then --rounds rounds of A alone and A and B, the modes taking turns within each round
    (so that the engines' drift over the run falls on every mode alike). With several rounds each figure is
    the median of the rounds' (each round's ratio is of its own two phases); "rounds" has them all.
    lone_user_ratio: A alone's tokens/s under fair share over first come first served's, per round, the median."""
    results: dict[str, dict] = {}
    mode_args = {mode: args if mode != "floor" else argparse.Namespace(
        **{**vars(args), "a_in_flight": (args.max_num_seqs - 1) * len(args.engines)}) for mode in targets}
    for mode, target in targets.items():
        await phase(target, "A", argparse.Namespace(**{**vars(mode_args[mode]), "phase_s": 5}))  # warm, unmeasured
        results[mode] = {"B alone": await phase(target, "B", mode_args[mode]), "rounds": []}
    for _ in range(args.rounds):
        for mode, target in targets.items():
            point = results[mode]
            alone = await phase(target, "A", mode_args[mode])
            both = await phase(target, "AB", mode_args[mode])
            point["rounds"].append({"A alone": alone, "A and B": both, **ratios(alone, both, point["B alone"])})
            print(json.dumps({mode: point["rounds"][-1]}), flush=True)
    for point in results.values():
        rounds = point["rounds"]
        middle = sorted(rounds, key=lambda r: r["throughput_ratio"])[len(rounds) // 2]
        point["A alone"], point["A and B"] = middle["A alone"], middle["A and B"]  # the median round's phases
        for figure in ("b_ttft_ratio", "throughput_ratio", "engine_throughput_ratio", "occupancy_ratio"):
            values = [r[figure] for r in rounds if figure in r]
            if len(values) == len(rounds):
                point[figure] = round(statistics.median(values), 3)
    lone = None
    if "fair" in results:  # what fair share costs a user alone: A alone's tokens/s against first come first served's
        pairs = zip(results["fair"]["rounds"], results["fcfs"]["rounds"], strict=True)
        lone = round(statistics.median(fair["A alone"]["tokens_per_s"] / fcfs["A alone"]["tokens_per_s"]
                                       for fair, fcfs in pairs), 3)
    for point in results.values():
        if len(point["rounds"]) == 1:
            del point["rounds"]
    if lone is not None:
        results["lone_user_ratio"] = lone
    return results


def run_calibrated(targets: dict[str, Target], args: argparse.Namespace, min_b_rate: float) -> dict:
    """run, with --b-rate 0 set first to B_SHARE of A's rate alone (through the first come first served
    data plane, at least min_b_rate); the rate B sent goes with the results."""
    if args.b_rate <= 0:
        a_rate = asyncio.run(calibrate(targets["fcfs"], args))
        args.b_rate = round(max(a_rate * B_SHARE, min_b_rate), 3)
        print(f"A alone: {a_rate:.2f} requests/s over {CALIBRATE_S:g} s: B sends {args.b_rate}/s", flush=True)
    results = asyncio.run(run(targets, args))
    results["b_rate"] = args.b_rate
    return results


def mode_targets(here, urls: list[str], capacity: int, model: str = "tiny",
                 workers: int = 1, modes: tuple[str, ...] = ("fair", "fcfs")) -> dict[str, Target]:
    """One data plane per mode over the engines (each told its capacity): fair share with A's and B's own keys
    (projects of equal shares), first come first served (and the floor) with the deployment's key for both."""
    key_file = here.key_file(KEY)
    database = here.folder / "tenancy.sqlite"
    store = open_store(database)
    keys = {"A": add_key(store, "a", project="pa")[0], "B": add_key(store, "b", project=B_PROJECT)[0]}
    store.close()
    settings = {"fair": here.tenancy(database), "nopause": here.tenancy(database, pause=False, name="nopause")}
    targets = {}
    for mode in modes:
        router = Router("127.0.0.1", free_port(), key_file, here.folder / f"plane-{mode}.log", model=model,
                        admin_socket=here.folder / mode / "admin.sock", workers=workers,
                        options=["--tenancy", str(settings[mode])] if mode in settings else [])
        here.routers.append(router)
        router.start([])
        for url in urls:
            router.add(url, capacity=capacity)
        targets[mode] = (Target(router.url, keys, router.metrics, router.pid) if mode in settings
                         else Target(router.url, {"A": KEY, "B": KEY}, pid=router.pid))
    return targets


def modes(text: str) -> tuple[str, ...]:
    chosen = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in chosen if m not in MODES]
    if unknown or "fcfs" not in chosen:  # run_calibrated calibrates B's rate through fcfs
        raise SystemExit(f"--modes: {text!r}: choose among {', '.join(MODES)}, fcfs included")
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--a-in-flight", type=int, default=24)
    parser.add_argument("--b-rate", type=float, default=0.0, help="B's requests/s; 0: a tenth of A's, measured")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--vary-tokens", type=float, default=0.0,
                        help="each request's output tokens uniform within +- this fraction of --tokens (0: all alike)")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--engine-cores", default="0,1",
                        help="one vLLM engine on each of these cores (comma-separated); '1' leaves core 0 to the "
                             "data plane, the clients and the engine's API server")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--standin-token-ms", type=float, default=0.0,
                        help="stand-ins instead of vLLM (see above)")
    parser.add_argument("--standin-first-ms", type=float, default=40.0)
    parser.add_argument("--modes", default="fair,fcfs", help=f"comma-separated, run in this order, of {MODES}")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of A alone and A and B per mode (see run)")
    args = parser.parse_args()
    with workspace("hpcserve-fair-bench-") as here:
        if args.standin_token_ms:
            engines, urls = start_stubs(here.folder, args.tokens, (
                "--model", "tiny", "--slots", str(args.max_num_seqs), "--token-delay-ms", str(args.standin_token_ms),
                "--first-token-delay-ms", str(args.standin_first_ms)))
        else:
            # Eager: compiled, each new batch shape stalled its engine for seconds (tokens/s 10-47 over the
            # first minutes, B's TTFT alone 0.56 s in the first mode and 0.03 s in the second), so the modes'
            # phases were not comparable.
            cores = tuple(int(c) for c in args.engine_cores.split(","))
            engines, urls = start_engines(here.folder, cores, extra=("--max-num-seqs", str(args.max_num_seqs),
                                                                     "--enforce-eager"))
        here.processes += engines
        targets = mode_targets(here, urls, args.max_num_seqs, modes=modes(args.modes))
        args.engines = urls
        finish(run_calibrated(targets, args, min_b_rate=0.02), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
