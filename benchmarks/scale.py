"""The endpoint's control plane at 16, 64, 256 replicas, measured with stand-ins.

    flock /tmp/hpcserve-heavy.lock .venv/bin/python benchmarks/scale.py --replicas 16,64,256 --json out.json

For each replica count N: a farm of stand-ins (hpcserve.testing.standin --count, one process, a real
vLLM /metrics page each), and the real endpoint process (endpoint.control.process.run: the real Controller and
the real vllm-router process) whose members are those stand-ins (hpcserve.testing.endpoint, through
the controller's launcher seam). Then, in order:

  idle       the controller's round time (p50/p99, from its state.json), its CPU and the router's,
             probe traffic (requests/s and bytes/s the farm answered to /health and /metrics)
  latency    the same open-loop rate straight to the stand-ins and through the router, in alternating
             blocks: the router's added latency (p50/p99) at that rate; zero service time
  ceiling    a closed loop of clients through the router: the highest rate it completes here
  kill       10 % of the stand-ins killed at once (as kill -9) under an open-loop load: failed
             requests, how long until every killed one is out of the router, how long the
             replacements (self-healing) take to join, the round time meanwhile

The load generator (benchmarks/scale_load.py) is a process of its own. Everything shares this
machine's cores: see benchmarks/results/scale.md for how to read the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import yaml

from hpcserve.benchmark.stats import percentile
from hpcserve.core.config import parse_config
from hpcserve.core.files import read_json
from hpcserve.core.keys import choose_key
from hpcserve.core.net import free_loopback_port
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import Record
from hpcserve.core.runstate import RunState
from hpcserve.core.statuses import RunKind, RunStatus
from hpcserve.deployment.runs import LocalRun
from hpcserve.endpoint.control.plane_client import Router
from hpcserve.testing.endpoint import FARM_ENV
from hpcserve.testing.harness import ports_to_listen_on, spawn, stop, wait_until
from hpcserve.testing.members import FarmClient

KEY = "scale-bench-key"
KEY_ENV = "HPCSERVE_SCALE_KEY"
HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
MIN_ROUNDS, IDLE_MAX_S = 3, 150


# ------------------------------------------------------------------ the pieces

def start_farm(directory: Path, count: int, small_metrics: bool) -> tuple[subprocess.Popen, FarmClient, list[int]]:
    *ports, admin = ports_to_listen_on(count + 1)
    proc = spawn([PYTHON, "-m", "hpcserve.testing.standin", "--ports", ",".join(map(str, ports)),
                  "--admin-port", str(admin)] + (["--small-metrics"] if small_metrics else []),
                 directory / "farm.log", {"HPCSERVE_STUB_API_KEY": KEY})
    farm = FarmClient(f"http://127.0.0.1:{admin}")
    wait_until(lambda: len(farm.describe()["standins"]) == count, 120, "the farm's admin API")
    # Every stand-in stays stopped until a member takes it: the farm starts all of them.
    farm.act("stop", ports)
    return proc, farm, ports


def endpoint_config(replicas: int, port: int) -> dict:
    return {"name": f"scale{replicas}", "model": {"path": "builtin:tiny-llama", "served_name": "stub"},
            "cluster": {"scheduler": "local", "cpus_per_node": replicas},
            "parallelism": {"tensor": 1, "pipeline": 1, "replicas": replicas},
            "serve": {"host": "127.0.0.1", "port": port, "api_key_env": KEY_ENV}}


def start_endpoint(directory: Path, replicas: int, farm: FarmClient) -> Record:
    os.environ[KEY_ENV] = KEY
    raw = endpoint_config(replicas, free_loopback_port())
    (directory / "endpoint.yaml").write_text(yaml.safe_dump(raw))
    cfg = parse_config(raw)
    return LocalRun.start(cfg, directory, "hpcserve.testing.endpoint", RunKind.ENDPOINT,
                          choose_key(KEY_ENV, False), {FARM_ENV: farm.admin_url}).record


def state(record: Record) -> dict:
    return read_json(RunPaths(Path(record.run_dir)).state, {}) or {}


class Rounds:
    """Round durations as the controller reports them (state.json: control.round_ms_recent)."""

    def __init__(self, record: Record):
        self.record, self.seen, self.durations = record, None, []

    def poll(self) -> None:
        control = state(self.record).get("control") or {}
        rounds, recent = control.get("rounds"), control.get("round_ms_recent") or []
        if rounds is None:
            return
        if self.seen is not None and rounds > self.seen:
            self.durations += recent[-min(len(recent), rounds - self.seen):]
        self.seen = rounds

    def reset(self) -> None:
        self.poll()
        self.durations = []

    def summary(self) -> dict:
        d = self.durations
        control = state(self.record).get("control") or {}  # rotation steps: over the last 300 (60 s)
        return {"rounds": len(d), "round_ms_p50": percentile(d, 50), "round_ms_p99": percentile(d, 99),
                "round_ms_max": max(d) if d else None,
                **{k: control.get(k) for k in ("step_ms_p50", "step_ms_p99", "step_ms_max")}}


ADMIN_SOCKETS: dict[str, Path] = {}  # endpoint URL -> its data plane's admin socket (membership is read there)


def router_of(record: Record) -> tuple[str, int]:
    st = RunState.read(record.run_dir)
    ADMIN_SOCKETS[st.endpoint_url] = RunPaths(Path(record.run_dir)).router_admin
    return st.endpoint_url, st.router_pid


def router_workers(url: str) -> set[str]:
    """The replicas the endpoint's data plane routes to (its admin socket: the client port has no admin route)."""
    return backends_on(ADMIN_SOCKETS[url])


def backends_on(admin_socket: Path) -> set[str]:
    admin = Router("127.0.0.1", 0, None, admin_socket.parent / "unused.log", admin_socket=admin_socket)
    try:
        return {b.url for b in admin.backends()}
    finally:
        admin.close()


def cpu_seconds(pid: int) -> float:
    try:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    except psutil.Error:
        return 0.0


def farm_reads(farm: FarmClient) -> tuple[int, int]:
    standins = farm.describe()["standins"]
    return sum(s["health_reads"] for s in standins), sum(s["metrics_reads"] for s in standins)


def load(directory: Path, tag: str, target: list[str], seconds: float, rate: float = 0.0,
         concurrency: int = 64, wait: bool = True) -> subprocess.Popen | dict:
    out = directory / f"load-{tag}.json"
    argv = [PYTHON, str(HERE / "scale_load.py"), "--duration-s", str(seconds), "--key", KEY, "--out", str(out)]
    argv += ["--url", target[0]] if len(target) == 1 else ["--urls", ",".join(target)]
    argv += ["--rate", str(rate)] if rate else ["--concurrency", str(concurrency)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(directory / f"load-{tag}.err", "w"))
    if not wait:
        return proc
    proc.wait(timeout=seconds + 120)
    return json.loads(out.read_text())


def finish_load(proc: subprocess.Popen, directory: Path, tag: str, seconds: float) -> dict:
    proc.wait(timeout=seconds + 120)
    return json.loads((directory / f"load-{tag}.json").read_text())


def latency_summary(result: dict) -> dict:
    lat = result["latency_ms"]
    return {"ok": result["ok"], "failed": result["failed"], "rps": round(result["achieved_rps"], 1),
            "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
            "lateness_p99_ms": round(result["lateness_p99_ms"], 2), "errors": result["errors"]}


# ------------------------------------------------------------------ the phases

def phase_idle(record: Record, farm: FarmClient, router_pid: int, rounds: Rounds, seconds: float) -> dict:
    ctl_pid = record.driver_pid
    rounds.reset()
    cpu0 = {"controller": cpu_seconds(ctl_pid), "router": cpu_seconds(router_pid)}
    reads0, t0 = farm_reads(farm), time.monotonic()
    # At least MIN_ROUNDS rounds, however long a round takes (up to IDLE_MAX_S)
    while time.monotonic() < t0 + seconds or (len(rounds.durations) < MIN_ROUNDS and
                                              time.monotonic() < t0 + IDLE_MAX_S):
        time.sleep(2)
        rounds.poll()
    wall = time.monotonic() - t0
    reads1 = farm_reads(farm)
    health, metrics = ((reads1[i] - reads0[i]) / wall for i in (0, 1))
    return {**rounds.summary(), "seconds": round(wall, 1),
            "controller_cpu": round((cpu_seconds(ctl_pid) - cpu0["controller"]) / wall, 3),
            "router_cpu": round((cpu_seconds(router_pid) - cpu0["router"]) / wall, 3),
            "health_per_s": round(health, 1), "metrics_per_s": round(metrics, 1)}


def phase_latency(directory: Path, router_url: str, rate: float, blocks: int, seconds: float) -> dict:
    runs: dict[str, list[dict]] = {"direct": [], "router": []}
    for index in range(blocks):
        order = ("direct", "router") if index % 2 == 0 else ("router", "direct")
        for mode in order:
            # Direct: the replicas in the router now (an overloaded farm may have lost and replaced some)
            target = sorted(router_workers(router_url)) if mode == "direct" else [router_url]
            runs[mode].append(load(directory, f"lat-{rate:g}-{mode}-{index}", target, seconds, rate=rate))
    merged = {mode: {"latency_ms": [x for r in rs for x in r["latency_ms"]], "ok": sum(r["ok"] for r in rs),
                     "failed": sum(r["failed"] for r in rs),
                     "achieved_rps": statistics.mean(r["achieved_rps"] for r in rs),
                     "lateness_p99_ms": max(r["lateness_p99_ms"] for r in rs),
                     "errors": {k: v for r in rs for k, v in r["errors"].items()}}
              for mode, rs in runs.items()}
    d, r = latency_summary(merged["direct"]), latency_summary(merged["router"])
    return {"rate": rate, "direct": d, "router": r,
            "added_p50_ms": round(r["p50_ms"] - d["p50_ms"], 3) if d["p50_ms"] and r["p50_ms"] else None,
            "added_p99_ms": round(r["p99_ms"] - d["p99_ms"], 3) if d["p99_ms"] and r["p99_ms"] else None}


def phase_ceiling(directory: Path, router_url: str, seconds: float, concurrency: int) -> dict:
    routed = latency_summary(load(directory, "ceiling-router", [router_url], seconds, concurrency=concurrency))
    straight = latency_summary(load(directory, "ceiling-direct", sorted(router_workers(router_url)), seconds,
                                    concurrency=concurrency))
    return {"concurrency": concurrency, "router": routed, "direct": straight}


def phase_kill(directory: Path, record: Record, farm: FarmClient, router_url: str, rounds: Rounds,
               rate: float, seconds: float) -> dict:
    serving = sorted(router_workers(router_url))
    victims = serving[:: max(1, len(serving) // max(1, len(serving) // 10))][: max(1, len(serving) // 10)]
    ports = [int(u.rsplit(":", 1)[1]) for u in victims]
    before = {m["name"] for m in state(record).get("members", [])}
    proc = load(directory, "kill", [router_url], seconds, rate=rate, wait=False)
    time.sleep(seconds / 4)
    rounds.reset()
    killed = time.monotonic()
    farm.act("kill", ports)
    left: dict[str, float] = {}
    deadline = killed + 120
    while len(left) < len(victims) and time.monotonic() < deadline:
        present = router_workers(router_url)
        for url in victims:
            if url not in present and url not in left:
                left[url] = time.monotonic() - killed
        time.sleep(0.05)
        rounds.poll()
    result = finish_load(proc, directory, "kill", seconds)
    wait_until(lambda: sum(1 for m in state(record).get("members", []) if m["name"] not in before
                           and m["status"] == "serving") >= len(victims), 120, "the replacements to join")
    rounds.poll()
    joined = [m["ready_s"] for m in state(record).get("members", []) if m["name"] not in before and m["ready_s"]]
    leave = sorted(left.values())
    return {"killed": len(victims), "rate": rate, "load": latency_summary(result),
            "out_of_router_s_max": round(leave[-1], 2) if len(leave) == len(victims) else None,
            "out_of_router_s_p50": round(percentile(leave, 50), 2) if leave else None,
            "never_left": len(victims) - len(leave),
            "replacement_join_s_max": round(max(joined), 2) if joined else None, **rounds.summary()}


# ------------------------------------------------------------------ one replica count

def measure(replicas: int, args: argparse.Namespace, root: Path) -> dict:
    directory = root / f"n{replicas}"
    directory.mkdir(parents=True)
    farm_proc, farm, ports = start_farm(directory, replicas + max(2, replicas // 10) + 2, args.small_metrics)
    record = None
    result: dict = {"replicas": replicas}
    try:
        t0 = time.monotonic()
        record = start_endpoint(directory, replicas, farm)
        wait_until(lambda: state(record).get("status") == RunStatus.READY or
                   state(record).get("status") == RunStatus.FAILED, args.ready_timeout_s, "the endpoint's ready")
        if state(record).get("status") != RunStatus.READY:
            raise RuntimeError(f"the endpoint failed: {state(record).get('error')}")
        result["ready_s"] = round(time.monotonic() - t0, 1)
        router_url, router_pid = router_of(record)
        direct = sorted(router_workers(router_url))
        rounds = Rounds(record)
        result["idle"] = phase_idle(record, farm, router_pid, rounds, args.idle_s)
        page = len(httpx.get(f"{direct[0]}/metrics", timeout=5).content)
        result["idle"]["metrics_bytes_per_s"] = round(result["idle"]["metrics_per_s"] * page)
        print(f"N={replicas} ready {result['ready_s']} s; idle {result['idle']}", flush=True)
        result["latency"] = []
        for rate in [float(r) for r in args.rates.split(",") if r]:
            point = phase_latency(directory, router_url, rate, args.blocks, args.block_s)
            result["latency"].append(point)
            print(f"N={replicas} latency at {rate:g}/s: {json.dumps(point)}", flush=True)
        if args.ceiling_s:
            result["ceiling"] = phase_ceiling(directory, router_url, args.ceiling_s, args.concurrency)
            print(f"N={replicas} ceiling: {json.dumps(result['ceiling'])}", flush=True)
        if args.kill_s:
            result["kill"] = phase_kill(directory, record, farm, router_url, rounds, args.kill_rate, args.kill_s)
            print(f"N={replicas} kill: {json.dumps(result['kill'])}", flush=True)
    finally:
        if record is not None:
            LocalRun(record).stop(timeout_s=60)
        stop(farm_proc)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="16,64,256")
    parser.add_argument("--idle-s", type=float, default=20)
    parser.add_argument("--rates", default="200,1000", help="open-loop rates for the added latency")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--block-s", type=float, default=8)
    parser.add_argument("--ceiling-s", type=float, default=8)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--kill-rate", type=float, default=200)
    parser.add_argument("--kill-s", type=float, default=24)
    parser.add_argument("--ready-timeout-s", type=float, default=600)
    parser.add_argument("--small-metrics", action="store_true",
                        help="stand-ins serve only the four figures read (not vLLM's 50 KB page): the farm, one "
                             "process for every replica, then spends its CPU on requests, not on pages")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="scale-", dir=os.environ.get("HPCSERVE_SCRATCH")))
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}",
               "args": {k: str(v) for k, v in vars(args).items()}, "points": []}
    for replicas in [int(n) for n in args.replicas.split(",")]:
        results["points"].append(measure(replicas, args, root))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    print(f"logs: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
