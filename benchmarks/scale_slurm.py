"""An endpoint of 32 members as real Slurm jobs on a 32-node sandbox: Slurm only, each job
running a stand-in member (hpcserve.testing.member) instead of Ray and vLLM.

    flock /tmp/hpcserve-heavy.lock .venv/bin/python benchmarks/scale_slurm.py [--nodes 32] --json out.json

Two runs of the real endpoint process (hpcserve.testing.endpoint: the real Controller and router, the
members launched by deployment.runs.Runs with the member module swapped), under load through the
endpoint (benchmarks/scale_load.py, non-streamed):

  scale     4 members at start, autoscale 4..32: a closed loop of clients keeps each member's queue
            above target until 32 serve; then no load until it is back at 4. Checked: jobs submitted
            (4 + scale-ups), jobs left running (4), failed requests (0).
  handover  32 members at start with a short time limit: each gets its successor before the limit and
            is drained, under a constant rate of requests. Checked: 32 successors, no job ended by
            TIMEOUT, failed requests (0).

Measured meanwhile: the controller's round time, its squeue calls, slurmctld's CPU and the
controller's, the time from a launch decision to the job running and to the member joining, and
squeue's own latency at this size. The sandbox lives under its own root and node prefix and is
taken down at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

from hpcserve.benchmark.stats import percentile
from hpcserve.core.config import parse_config
from hpcserve.core.keys import choose_key
from hpcserve.core.net import free_loopback_port
from hpcserve.core.registry import Record
from hpcserve.core.statuses import RunKind, RunStatus
from hpcserve.deployment.runs import LocalRun
from hpcserve.sandbox.cluster import Sandbox
from hpcserve.testing.endpoint import MEMBER_ENV
from hpcserve.testing.harness import wait_until
from hpcserve.testing.member import SLOTS_ENV, TOKEN_DELAY_ENV

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import KEY, KEY_ENV, Rounds, cpu_seconds, load, state  # noqa: E402

SANDBOX_ROOT, SANDBOX_PREFIX = Path("/tmp/hpcserve-sandbox-scale"), "hx"


def config(name: str, replicas: int, port: int, results: Path, time_limit: str, handover_s: float | None,
           autoscale: dict | None) -> dict:
    raw = {"name": name, "model": {"path": "builtin:tiny-llama", "served_name": "stub"},
           # nodes: what the layout check counts; each member's job asks for one node, one CPU
           "cluster": {"scheduler": "slurm", "nodes": replicas, "cpus_per_node": 1, "gpus_per_node": 0,
                       "time": time_limit},
           "parallelism": {"tensor": 1, "pipeline": 1, "replicas": replicas},
           # 16 tokens of 20 ms, 2 at once: about 6 requests/s a member, so a loop of clients queues
           "engine": {"env": {TOKEN_DELAY_ENV: "20", SLOTS_ENV: "2"}},
           "serve": {"host": "0.0.0.0", "port": port, "api_key_env": KEY_ENV, "handover_s": handover_s},
           "results_dir": str(results)}
    if autoscale:
        raw["autoscale"] = autoscale
    return raw


def start(directory: Path, raw: dict) -> Record:
    os.environ[KEY_ENV] = KEY
    (directory / f"{raw['name']}.yaml").write_text(yaml.safe_dump(raw))
    return LocalRun.start(parse_config(raw), directory, "hpcserve.testing.endpoint", RunKind.ENDPOINT,
                          choose_key(KEY_ENV, False), {MEMBER_ENV: "1"}).record


def serving(record: Record) -> list[dict]:
    return [m for m in state(record).get("members", []) if m["status"] == "serving"]


def router_url(record: Record) -> str:
    return (state(record).get("endpoint") or {})["url"]


def jobs_of(name: str) -> dict[str, str]:
    """Every job of the endpoint Slurm still shows (all states): id -> state."""
    out = subprocess.run(["squeue", "--noheader", "--states=all", "--format=%i|%T|%j"], capture_output=True,
                         text=True, timeout=30).stdout
    return {line.split("|")[0]: line.split("|")[1] for line in out.splitlines()
            if line.count("|") >= 2 and line.split("|", 2)[2].startswith(f"hpcserve-{name}-")}


class Meter:
    """CPU seconds of slurmctld and the controller, and the rounds, from a start."""

    def __init__(self, sandbox: Sandbox, record: Record):
        self.pids = {"slurmctld": sandbox._daemon_pid(sandbox.controller), "controller": record.driver_pid}
        self.cpu0 = {k: cpu_seconds(p) for k, p in self.pids.items()}
        self.t0 = time.monotonic()
        self.rounds = Rounds(record)
        self.rounds.reset()
        self.queries0 = (state(record).get("control") or {}).get("slurm_queries") or 0
        self.record = record

    def poll(self) -> None:
        self.rounds.poll()

    def summary(self) -> dict:
        wall = time.monotonic() - self.t0
        queries = ((state(self.record).get("control") or {}).get("slurm_queries") or 0) - self.queries0
        return {"seconds": round(wall, 1), **self.rounds.summary(),
                **{f"{k}_cpu": round((cpu_seconds(p) - self.cpu0[k]) / wall, 3) for k, p in self.pids.items()},
                "squeue_calls": queries, "squeue_calls_per_5s": round(queries / wall * 5, 2)}


def join_times(record: Record) -> list[float]:
    return [m["ready_s"] for m in state(record).get("members", []) if m.get("ready_s")]


def wait_ready(record: Record, timeout_s: float) -> None:
    wait_until(lambda: state(record).get("status") in (RunStatus.READY, RunStatus.FAILED), timeout_s, "ready")
    if state(record).get("status") != RunStatus.READY:
        raise RuntimeError(f"the endpoint failed: {state(record).get('error')}")


def run_scale(sandbox: Sandbox, directory: Path, args: argparse.Namespace) -> dict:
    name = "scale-sl"
    raw = config(name, args.min, free_loopback_port(), directory / "results", "30", None,
                 {"min": args.min, "max": args.max, "target_queue": 2, "scale_up_after_s": 2,
                  "scale_down_after_s": 10})
    record = start(directory, raw)
    result: dict = {"min": args.min, "max": args.max}
    try:
        t0 = time.monotonic()
        wait_ready(record, 300)
        result["ready_s"] = round(time.monotonic() - t0, 1)
        url = router_url(record)
        meter = Meter(sandbox, record)
        loads, up_started = [], time.monotonic()
        # A closed loop of clients in 30 s chunks until every member serves (each chunk bounded)
        while len(serving(record)) < args.max and time.monotonic() - up_started < args.up_timeout_s:
            loads.append(load(directory, f"scale-up-{len(loads)}", [url], 30, concurrency=args.clients))
            meter.poll()
            print(f"scale up: {len(serving(record))} serving after {time.monotonic() - up_started:.0f} s", flush=True)
        result["up_s"] = round(time.monotonic() - up_started, 1)
        result["up_serving"] = len(serving(record))
        result["memory_at_max"] = memory(sandbox, record)
        result["up"] = meter.summary()
        down_started = time.monotonic()
        meter = Meter(sandbox, record)
        while len(serving(record)) > args.min and time.monotonic() - down_started < 300:
            time.sleep(2)
            meter.poll()
        result["down_s"] = round(time.monotonic() - down_started, 1)
        result["down_serving"] = len(serving(record))
        result["down"] = meter.summary()
        time.sleep(15)  # the drained ones' jobs end
        jobs = jobs_of(name)
        members = state(record).get("members", [])
        result["jobs"] = {"submitted": len(members), "known_to_squeue": len(jobs),
                          "running": sum(1 for s in jobs.values() if s == "RUNNING"),
                          "states": sorted(set(jobs.values())),
                          "scale_ups": sum(1 for m in members if m["role"] == "scale-up"),
                          "replacements": sum(1 for m in members if m["role"] == "replacement")}
        result["requests"] = {"ok": sum(r["ok"] for r in loads), "failed": sum(r["failed"] for r in loads),
                              "errors": {k: v for r in loads for k, v in r["errors"].items()}}
        joins = join_times(record)
        result["join_s"] = {"p50": percentile(joins, 50), "max": max(joins) if joins else None}
    finally:
        LocalRun(record).stop(timeout_s=120)
    return result


def run_handover(sandbox: Sandbox, directory: Path, args: argparse.Namespace) -> dict:
    name = "hand-sl"
    raw = config(name, args.max, free_loopback_port(), directory / "results", str(args.handover_limit_min),
                 args.handover_s, None)
    record = start(directory, raw)
    result: dict = {"members": args.max, "time_limit_min": args.handover_limit_min, "handover_s": args.handover_s}
    try:
        t0 = time.monotonic()
        wait_ready(record, 600)
        result["ready_s"] = round(time.monotonic() - t0, 1)
        url = router_url(record)
        first = {m["name"] for m in serving(record)}
        meter = Meter(sandbox, record)
        loads = []
        deadline = time.monotonic() + args.handover_limit_min * 60 + 120

        def handed_over() -> int:
            members = state(record).get("members", [])
            return sum(1 for m in members if m["name"] in first and m["status"] in ("gone", "stopping")
                       and m.get("successor"))

        while handed_over() < len(first) and time.monotonic() < deadline:
            loads.append(load(directory, f"handover-{len(loads)}", [url], 20, rate=args.rate))
            meter.poll()
            print(f"handover: {handed_over()} of {len(first)} handed over", flush=True)
        result["handed_over"] = handed_over()
        result["during"] = meter.summary()
        members = state(record).get("members", [])
        jobs = jobs_of(name)
        old_jobs = [m["record"]["job_id"] for m in members if m["name"] in first]
        result["jobs"] = {"submitted": len(members),
                          "successors": sum(1 for m in members if m["role"] == "successor"),
                          "old_states": sorted({jobs.get(j, "unknown") for j in old_jobs}),
                          "timeouts": sum(1 for s in jobs.values() if s == "TIMEOUT")}
        result["requests"] = {"ok": sum(r["ok"] for r in loads), "failed": sum(r["failed"] for r in loads),
                              "errors": {k: v for r in loads for k, v in r["errors"].items()}}
        successors = [m["ready_s"] for m in members if m["role"] == "successor" and m.get("ready_s")]
        result["successor_join_s"] = {"p50": percentile(successors, 50), "max": max(successors) if successors else None}
    finally:
        LocalRun(record).stop(timeout_s=120)
    return result


def slurm_latency() -> dict:
    """squeue for every job and an sbatch that only asks slurmctld (--test-only), timed from the login
    node at this size: what one Slurm query and one submission cost here."""
    def timed(argv: list[str]) -> list[float]:
        times = []
        for _ in range(5):
            started = time.perf_counter()
            subprocess.run(argv, capture_output=True, timeout=30)
            times.append((time.perf_counter() - started) * 1000)
        return times

    squeue = timed(["squeue", "--noheader", "--states=all"])
    sbatch = timed(["sbatch", "--test-only", "-N1", "-n1", "-t1", "--wrap=true"])
    return {"squeue_ms_p50": round(percentile(squeue, 50), 1), "squeue_ms_max": round(max(squeue), 1),
            "sbatch_test_only_ms_p50": round(percentile(sbatch, 50), 1)}


def memory(sandbox: Sandbox, record: Record) -> dict:
    """Resident memory of the sandbox's nodes (their processes, members included) and the controller."""
    def rss(pids: list[int]) -> float:
        total = 0
        for pid in pids:
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        return round(total / 2**30, 2)

    return {"nodes_rss_gib": rss([p for n in sandbox.node_names() for p in sandbox.node_pids(n)]),
            "controller_rss_gib": rss([record.driver_pid]), "used_gib": round(psutil.virtual_memory().used / 2**30, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--min", type=int, default=4)
    parser.add_argument("--max", type=int, default=32)
    parser.add_argument("--clients", type=int, default=160, help="closed-loop clients while scaling up")
    parser.add_argument("--up-timeout-s", type=float, default=480)
    parser.add_argument("--rate", type=float, default=40, help="requests/s during the handover")
    parser.add_argument("--handover-limit-min", type=int, default=3)
    parser.add_argument("--handover-s", type=float, default=120)
    parser.add_argument("--runs", default="scale,handover")
    parser.add_argument("--keep-sandbox", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="scale-slurm-", dir=os.environ.get("HPCSERVE_SCRATCH")))
    sandbox = Sandbox(root=SANDBOX_ROOT, nodes=args.nodes, prefix=SANDBOX_PREFIX)
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                          f"{psutil.virtual_memory().total / 2**30:.0f} GiB", "nodes": args.nodes}
    started = time.monotonic()
    mem0 = psutil.virtual_memory().used
    sandbox.up(timeout_s=180)
    results["sandbox_up_s"] = round(time.monotonic() - started, 1)
    results["sandbox_memory_gib"] = round((psutil.virtual_memory().used - mem0) / 2**30, 2)
    os.environ.update(sandbox.env())
    try:
        results["slurm"] = slurm_latency()
        for run in args.runs.split(","):
            results[run] = (run_scale if run == "scale" else run_handover)(sandbox, directory, args)
            print(f"{run}: {json.dumps(results[run])}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    finally:
        if not args.keep_sandbox:
            sandbox.down()
    print(f"logs: {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
