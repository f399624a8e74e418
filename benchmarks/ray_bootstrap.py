"""Time from job start to Ray ready for 1, 2 and 3 sandbox nodes, against a bare `ray start --head` on one
node and the sleep-based bootstrap peers use (10 s + 5 s per worker); and the health check of 3 nodes.

Runs against the Slurm sandbox (`hpcserve sandbox up`, root). Rounds are interleaved (bare, 1, 2, 3 nodes,
then again) so machine load hits every case alike; the ratio uses medians of the same run.
Usage: python benchmarks/ray_bootstrap.py [ROUNDS]   (prints a markdown table)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def bare_ray_start() -> float:
    """`ray start --head --block` until `ray health-check` answers: the floor any bootstrap pays."""
    temp = Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    t0 = time.monotonic()
    head = subprocess.Popen([RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
                             "--num-cpus=1", "--num-gpus=0", f"--temp-dir={temp}", "--include-dashboard=false",
                             "--disable-usage-stats"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    while subprocess.run([RAY, "health-check", "--address", f"127.0.0.1:{port}"], env=env,
                         capture_output=True).returncode != 0:
        time.sleep(0.2)
    elapsed = time.monotonic() - t0
    head.terminate()
    head.wait(timeout=60)
    shutil.rmtree(temp, ignore_errors=True)
    return elapsed


def hpcserve_check(nodes: int, work: Path) -> dict:
    cfg = yaml.safe_load((REPO / "tests" / "cluster" / "sandbox-check.yaml").read_text())
    cfg["cluster"].update(nodes=nodes, gpus_per_node=0)
    cfg["results_dir"] = str(work / f"n{nodes}")
    path = work / f"check-{nodes}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = subprocess.run([sys.executable, "-m", "hpcserve.cli.main", "check", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stdout + done.stderr)
    run_dir = max((work / f"n{nodes}" / "logs").glob("sb-check-check-*"), key=lambda p: p.stat().st_mtime)
    state = json.loads((run_dir / "state.json").read_text())
    events = {(e["stage"], e["event"]): e["time"] for e in json.loads((run_dir / "timeline.json").read_text())}
    shutil.rmtree(run_dir)
    return {"job_to_ray_ready_s": events[("ray", "done")] - state["job_started"],
            "ray_stage_s": events[("ray", "done")] - events[("ray", "started")],
            "health_s": events[("health", "done")] - events[("health", "started")]}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    from hpcserve.sandbox.cluster import ensure_sandbox

    os.environ.update(ensure_sandbox(nodes=3).env())
    work = Path(tempfile.mkdtemp(prefix="rb-work-"))
    bare, runs = [], {1: [], 2: [], 3: []}
    for _ in range(rounds):
        bare.append(bare_ray_start())
        for nodes in runs:
            runs[nodes].append(hpcserve_check(nodes, work))
    base = statistics.median(bare)
    print(f"bare `ray start --head` to healthy: median {base:.1f} s over {rounds} ({', '.join(f'{b:.1f}' for b in bare)})\n")
    print("| nodes | job start -> Ray ready (median s) | ratio to bare ray start | sleep-based bootstrap (s) | health check (median s) |")
    print("|---|---|---|---|---|")
    for nodes, items in runs.items():
        ready = statistics.median(r["job_to_ray_ready_s"] for r in items)
        health = statistics.median(r["health_s"] for r in items)
        sleeps = 10 + 5 * (nodes - 1)
        print(f"| {nodes} | {ready:.1f} | {ready / base:.2f} | >= {sleeps} (+ its own ray start, unchecked) | {health:.1f} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
