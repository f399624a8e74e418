"""Scale to zero on the Slurm sandbox (issue "zero"): how long a request for a model at zero waits for its
answer (Slurm's queue, then the engine's start), and whether any request fails over scale-down/wake cycles
under a bursty load.

    flock /tmp/hpcserve-heavy.lock .venv/bin/python benchmarks/zero_sandbox.py --json out.json

Runs as root: it brings up a sandbox of its own (hpcserve.sandbox, root /tmp/hpcserve-sandbox-zero, hosts
hz*, net 198.18.9.0/24) and takes it down at the end. The deployment is the real endpoint process
(hpcserve.testing.endpoint: data plane, controller) whose members are real Slurm jobs running a stand-in
engine (hpcserve.testing.member, as tests/cluster/test_burst_preemption.py runs them), with
`autoscale.min: 0` (max --max), `idle_s` --idle-s, `wake_wait_s` --wake-wait-s and `engine.sleep_mode: off`
(the stand-ins have no GPU: a sleeping model's job ends). The engine's start is made realistic by
`cluster.setup: ["sleep S"]` (--start-delay-s): the job runs that long before the stand-in serves, as a real
job spends loading vLLM and the weights.

Phases:
  asleep  after the start, wait until the model sleeps: GET /v1/models/stub says `asleep` and Slurm shows
          no job of the deployment (pending or running).
  single  --singles times: one non-streamed request to the sleeping model, timed to its answer; split into
          queue (request to the job's allocation, from slurmctld's log: the wake notice, sbatch, Slurm's
          scheduling), start (allocation to the replica serving, the join as the controller timed it:
          --start-delay-s plus the job's launch, the stand-in's start and the join) and the
          rest (serving to the answer); and the waking lines clients saw on GET /v1/models meanwhile (`queued`,
          `engine starting`, `serving`, each with when it was first seen). Then it waits until it sleeps again.
  bursts  --cycles times: a burst of --burst concurrent requests (every other one streamed), then an idle
          gap (--gap-s seconds, > idle_s; 0: until the model is asleep again, its job gone). Every
          request's outcome: 200 with the whole answer (--max-tokens tokens, a stream ending in [DONE]), or
          failed (another status, an error) or broken (200 but cut short, or an error event in the stream).
          Per burst: whether the model was asleep when it was sent, its first answer's latency (a stream's
          first token or a whole answer), its last answer's.

Options: --nodes (sandbox nodes, 2), --start-delay-s (10), --idle-s (5), --wake-wait-s (180), --max (1),
--singles (3), --cycles (4), --burst (8), --gap-s (0: until asleep), --max-tokens (16), --token-delay-ms (20,
the stand-in's time per token), --slots (4: requests a stand-in serves at once), --json FILE (the summary),
--logs DIR (copy the run folders and Slurm's logs there before removing them), --keep-sandbox. Prints the
JSON summary; exits 1 when a request failed or broke, or a phase did not finish. Everything it made under
/tmp (its work folder, the sandbox's root) is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import psutil

from hpcserve.benchmark.stats import percentile
from hpcserve.core.config import parse_config
from hpcserve.core.files import read_json
from hpcserve.core.keys import choose_key
from hpcserve.core.net import free_loopback_port
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import Record
from hpcserve.core.statuses import RunKind
from hpcserve.deployment.runs import LocalRun
from hpcserve.sandbox.cluster import Sandbox
from hpcserve.testing.endpoint import MEMBER_ENV
from hpcserve.testing.harness import wait_until
from hpcserve.testing.member import SLOTS_ENV, TOKEN_DELAY_ENV

NAME, MODEL, KEY_ENV = "zero-sb", "stub", "HPCSERVE_ZERO_BENCH_KEY"
SANDBOX = {"root": Path("/tmp/hpcserve-sandbox-zero"), "prefix": "hz", "net": "198.18.9"}


def config(args: argparse.Namespace, port: int, results: Path) -> dict:
    return {"name": NAME, "model": {"path": "builtin:tiny-llama", "served_name": MODEL},
            "cluster": {"scheduler": "slurm", "partition": "debug", "nodes": 1, "cpus_per_node": 1,
                        "gpus_per_node": 0, "time": "30", "setup": [f"sleep {args.start_delay_s:g}"]},
            "engine": {"env": {TOKEN_DELAY_ENV: str(args.token_delay_ms), SLOTS_ENV: str(args.slots)},
                       "sleep_mode": "off"},
            "serve": {"host": "0.0.0.0", "port": port, "api_key_env": KEY_ENV, "handover": False},
            "autoscale": {"min": 0, "max": args.max, "idle_s": args.idle_s, "wake_wait_s": args.wake_wait_s,
                          "target_queue": 4, "scale_up_after_s": 5, "scale_down_after_s": args.idle_s},
            "results_dir": str(results)}


class Endpoint:
    """The running deployment: its state file, its URL, its model's state, its jobs in Slurm's queue."""

    def __init__(self, record: Record, key: str):
        self.record = record
        self.http = httpx.Client(timeout=30, trust_env=False, headers={"Authorization": f"Bearer {key}"})

    def state(self) -> dict:
        return read_json(RunPaths(Path(self.record.run_dir)).state, {}) or {}

    @property
    def url(self) -> str:
        return self.state()["endpoint"]["url"]

    def model(self) -> dict:
        try:
            return self.http.get(f"{self.url}/v1/models/{MODEL}").json()
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return {"state": f"unknown ({type(exc).__name__})"}

    def members(self) -> list[dict]:
        return self.state().get("members") or []

    def decisions(self, action: str, since: float) -> list[dict]:
        return [d for d in self.state().get("decisions") or [] if d["action"] == action and d["time"] >= since]


def jobs_in_queue() -> dict[str, str]:
    """The deployment's jobs Slurm shows as pending or running (squeue's default states): id -> state."""
    out = subprocess.run(["squeue", "--noheader", "--format=%i|%T|%j"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return {f[0]: f[1] for f in (line.split("|", 2) for line in out.splitlines())
            if len(f) == 3 and f[2].startswith(f"hpcserve-{NAME}")}


def wait_asleep(endpoint: Endpoint, timeout_s: float) -> float:
    """Until the model says asleep and none of its jobs is in Slurm's queue; returns the seconds waited."""
    started = time.monotonic()
    wait_until(lambda: endpoint.model().get("state") == "asleep" and not jobs_in_queue(), timeout_s,
               "the model asleep and its jobs gone", poll_s=0.5)
    return round(time.monotonic() - started, 2)


class WakingLines:
    """What GET /v1/models/stub said while a request waited (each distinct state and phase, when first seen)."""

    def __init__(self, endpoint: Endpoint, t0: float):
        self.endpoint, self.t0, self.seen = endpoint, t0, []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        last = None
        while not self.stopping.wait(0.25):
            card = self.endpoint.model()
            line = f"{card.get('state')}" + (f": {card['waking']}" if card.get("waking") else "")
            key = (card.get("state"), (card.get("waking") or "").split(" ")[0])
            if key != last:
                self.seen.append(f"+{time.time() - self.t0:.1f} s {line}")
                last = key

    def stop(self) -> list[str]:
        self.stopping.set()
        self.thread.join(5)
        return self.seen


def one_wake(endpoint: Endpoint, args: argparse.Namespace) -> dict:
    """One request to the sleeping model, timed, and where its time went."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": args.max_tokens}
    t0 = time.time()
    lines = WakingLines(endpoint, t0)
    try:
        reply = endpoint.http.post(f"{endpoint.url}/v1/completions", json=body, timeout=args.wake_wait_s + 60)
        status, text = reply.status_code, reply.text[:300]
    except httpx.HTTPError as exc:
        status, text = None, f"{type(exc).__name__}: {exc}"
    t1 = time.time()
    seen = lines.stop()
    result: dict = {"status": status, "total_s": round(t1 - t0, 2), "waking_lines": seen}
    if status != 200:
        result["error"] = text
        return result
    result["whole"] = reply.json()["choices"][0]["text"] == "x" * args.max_tokens

    def woken() -> dict | None:  # the member launched for it, once the controller recorded its join
        return next((m for m in endpoint.members() if m["launched"] >= t0 - 1 and m.get("job_started")
                     and m.get("startup_s") is not None), None)

    wait_until(woken, 30, "the woken member's join recorded", poll_s=0.2)
    member = woken() or {}
    serving = member["job_started"] + member["startup_s"]  # the join, as the controller timed it
    # Slurm's queue: request to slurmctld's allocation (its log, in ms; the process start time behind
    # job_started is off by up to a second, and Slurm's StartTime is in whole seconds)
    allocated = allocation_time(member["record"].get("job_id")) or member["job_started"]
    result.update(queue_s=round(allocated - t0, 2), start_s=round(serving - allocated, 2),
                  after_serving_s=round(t1 - serving, 2), member=member["name"],
                  job=member["record"].get("job_id"))
    wake = endpoint.decisions("wake", t0 - 1)
    if wake:
        result["wake_decision_s"] = round(wake[0]["time"] - t0, 2)
    return result


SLURMCTLD_LOG = SANDBOX["root"] / "log" / "slurmctld.log"


def allocation_time(job: str | None) -> float | None:
    """When slurmctld allocated the job (`[2026-12-06T08:33:48.416] sched: Allocate JobId=N ...`), epoch."""
    try:
        lines = SLURMCTLD_LOG.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if f"sched: Allocate JobId={job} " in line:
            return datetime.fromisoformat(line[1:line.index("]")]).timestamp()
    return None


async def one_request(client: httpx.AsyncClient, url: str, stream: bool, max_tokens: int, t0: float) -> dict:
    body = {"model": MODEL, "prompt": "tell me", "max_tokens": max_tokens, "stream": stream}
    out: dict = {"stream": stream, "status": None, "tokens": 0, "done": False, "error": None, "first_s": None}
    try:
        if not stream:
            reply = await client.post(f"{url}/v1/completions", json=body)
            out["status"] = reply.status_code
            if reply.status_code == 200:
                out["tokens"] = len(reply.json()["choices"][0]["text"])
                out["done"] = True
            else:
                out["error"] = reply.text[:200]
            out["first_s"] = out["last_s"] = time.time() - t0
            return out
        async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
            out["status"] = reply.status_code
            async for line in reply.aiter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = json.dumps(event["error"])[:200]
                    text = ((event.get("choices") or [{}])[0].get("text") or "")
                    if text and out["first_s"] is None:
                        out["first_s"] = time.time() - t0
                    out["tokens"] += len(text)
            if reply.status_code != 200:
                out["error"] = (await reply.aread()).decode(errors="replace")[:200]
    except (httpx.HTTPError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:200]
    out["last_s"] = time.time() - t0
    return out


def broken(r: dict, max_tokens: int) -> bool:
    return r["status"] == 200 and (not r["done"] or r["tokens"] != max_tokens or r["error"] is not None)


async def burst(url: str, key: str, args: argparse.Namespace) -> tuple[float, list[dict]]:
    limits = httpx.Limits(max_connections=args.burst + 4)
    async with httpx.AsyncClient(timeout=args.wake_wait_s + 60, trust_env=False, limits=limits,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        t0 = time.time()
        replies = await asyncio.gather(*(one_request(client, url, i % 2 == 1, args.max_tokens, t0)
                                         for i in range(args.burst)))
    return t0, list(replies)


def run_bursts(endpoint: Endpoint, key: str, args: argparse.Namespace) -> dict:
    cycles = []
    for cycle in range(args.cycles):
        state_at_send = endpoint.model().get("state")
        t0, replies = asyncio.run(burst(endpoint.url, key, args))
        failed = [r for r in replies if r["status"] != 200]
        cut = [r for r in replies if broken(r, args.max_tokens)]
        firsts = [r["first_s"] for r in replies if r["first_s"] is not None]
        row = {"cycle": cycle + 1, "model_at_send": state_at_send, "requests": len(replies),
               "streamed": sum(r["stream"] for r in replies), "ok": len(replies) - len(failed) - len(cut),
               "failed": len(failed), "broken": len(cut),
               "first_answer_s": round(min(firsts), 2) if firsts else None,
               "last_answer_s": round(max(r["last_s"] for r in replies), 2),
               "woke": bool(endpoint.decisions("wake", t0 - 1)),
               "errors": sorted({r["error"] for r in failed + cut if r["error"]})[:5]}
        print(f"burst {cycle + 1}: {json.dumps(row)}", flush=True)
        if cycle + 1 < args.cycles:
            if args.gap_s:
                time.sleep(args.gap_s)
                row["gap_s"] = args.gap_s
            else:
                row["gap_s"] = wait_asleep(endpoint, args.idle_s + 120)
        cycles.append(row)
    total = {k: sum(c[k] for c in cycles) for k in ("requests", "streamed", "ok", "failed", "broken")}
    firsts = [c["first_answer_s"] for c in cycles if c["first_answer_s"] is not None]
    return {"cycles": cycles, **total, "wakes": sum(c["woke"] for c in cycles),
            "first_answer_s": {"min": min(firsts, default=None), "p50": percentile(firsts, 50) if firsts else None,
                               "max": max(firsts, default=None)}}


def start_endpoint(directory: Path, args: argparse.Namespace) -> tuple[Record, str]:
    key = "zero-bench-" + os.urandom(6).hex()
    os.environ[KEY_ENV] = key
    raw = config(args, free_loopback_port(), directory / "results")
    record = LocalRun.start(parse_config(raw), directory, "hpcserve.testing.endpoint", RunKind.ENDPOINT,
                            choose_key(KEY_ENV, False), {MEMBER_ENV: "1"}).record
    return record, key


def measure(directory: Path, args: argparse.Namespace, results: dict, save) -> None:
    record, key = start_endpoint(directory, args)
    endpoint = Endpoint(record, key)
    try:
        wait_until(lambda: endpoint.state().get("status") in ("ready", "failed", "asleep"), 180, "the endpoint")
        if endpoint.state().get("status") == "failed":
            raise RuntimeError(f"the endpoint failed: {endpoint.state().get('error')}")
        results["asleep_after_start_s"] = wait_asleep(endpoint, args.start_delay_s + args.idle_s + 180)
        print(f"asleep after {results['asleep_after_start_s']} s", flush=True)
        singles = results["single"] = []
        for _ in range(args.singles):
            singles.append(one_wake(endpoint, args))
            print(f"single: {json.dumps(singles[-1])}", flush=True)
            singles[-1]["asleep_again_s"] = wait_asleep(endpoint, args.idle_s + 120)
            save()
        results["bursts"] = run_bursts(endpoint, key, args)
        save()
        results["decisions"] = sorted({d["action"] for d in endpoint.state().get("decisions") or []})
        results["jobs_submitted"] = len(endpoint.members())
    finally:
        left = LocalRun(record).stop(timeout_s=120)
        results["left_after_stop"] = {"pids": left, "jobs": jobs_in_queue()}


def summarize(results: dict) -> dict:
    singles = [s for s in results.get("single", []) if s.get("status") == 200]
    split = {k: [s[k] for s in singles if s.get(k) is not None] for k in ("total_s", "queue_s", "start_s")}
    bursts = results.get("bursts") or {}
    return {"singles_ok": f"{len(singles)}/{len(results.get('single', []))}",
            **{f"{k}_p50": percentile(v, 50) if v else None for k, v in split.items()},
            "total_s_max": max(split["total_s"], default=None),
            "burst_requests": bursts.get("requests"), "failed": bursts.get("failed"),
            "broken": bursts.get("broken"), "wakes": bursts.get("wakes")}


def passed(results: dict, args: argparse.Namespace) -> bool:
    singles = results.get("single", [])
    bursts = results.get("bursts") or {}
    return (len(singles) == args.singles and all(s.get("status") == 200 and s.get("whole") for s in singles)
            and len(bursts.get("cycles", [])) == args.cycles and bursts.get("failed") == 0
            and bursts.get("broken") == 0 and not results.get("error"))


def cleanup(sandbox: Sandbox, directory: Path, args: argparse.Namespace) -> None:
    """Logs copied where asked, the sandbox down, nothing of this run left under /tmp."""
    try:
        if args.logs:
            shutil.copytree(directory / "logs", args.logs / "runs", dirs_exist_ok=True, symlinks=True)
            shutil.copytree(sandbox.root / "log", args.logs / "slurm-log", dirs_exist_ok=True)
    except OSError as exc:
        print(f"logs not copied: {exc}", file=sys.stderr)
    try:
        if not args.keep_sandbox:
            sandbox.down()
            shutil.rmtree(sandbox.root, ignore_errors=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--start-delay-s", type=float, default=10.0, help="the job's time before the engine serves")
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--wake-wait-s", type=float, default=180.0)
    parser.add_argument("--max", type=int, default=1, help="autoscale.max")
    parser.add_argument("--singles", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--burst", type=int, default=8, help="concurrent requests a burst")
    parser.add_argument("--gap-s", type=float, default=0.0, help="idle gap after a burst; 0: until asleep")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--token-delay-ms", type=int, default=20)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="copy the run folders and Slurm's logs here")
    parser.add_argument("--keep-sandbox", action="store_true")
    args = parser.parse_args()
    if args.gap_s and args.gap_s <= args.idle_s:
        parser.error("--gap-s must be longer than --idle-s (or 0: until the model is asleep)")
    if os.geteuid() != 0:
        sys.exit("the sandbox needs root")
    directory = Path(tempfile.mkdtemp(prefix="zero-sandbox-"))
    os.environ["HPCSERVE_HOME"] = str(directory / "home")  # the run's records stay in its folder
    sandbox = Sandbox(nodes=args.nodes, **SANDBOX)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                                f"{psutil.virtual_memory().total / 2**30:.0f} GiB",
                     "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))

    started = time.monotonic()
    try:
        sandbox.up(timeout_s=180)
        results["sandbox_up_s"] = round(time.monotonic() - started, 1)
        os.environ.update(sandbox.env())
        measure(directory, args, results, save)
    except Exception as exc:  # noqa: BLE001 - recorded, and the run fails below
        results["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        results["seconds"] = round(time.monotonic() - started, 1)
        cleanup(sandbox, directory, args)
    results["summary"] = summarize(results)
    results["passed"] = passed(results, args)
    save()
    print(json.dumps(results["summary"] | {"passed": results["passed"], "error": results.get("error")}, indent=1))
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
