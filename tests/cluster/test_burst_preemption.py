"""A burst replica preempted under load on the sandbox: stand-in members as real Slurm jobs (hpcserve.testing.
member), the base replica on `debug`, autoscale adding one on the preemptible `scavenger` partition when its
queue rises (autoscale.burst); then another user's job on `high` takes the burst replica's node. Slurm sends
the job's --signal (USR1, preempt_send_user_signal) at once, the member tells the controller, which drains
it within the partition's GraceTime: its streams move to the base replica, and a replacement is asked for.
Streaming clients all along: not one request fails, not one stream is broken.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers import free_port
from test_slurm_ray import squeue_empty

from hpcserve.core.config import parse_config
from hpcserve.core.files import read_json
from hpcserve.core.keys import choose_key
from hpcserve.core.paths import RunPaths
from hpcserve.core.statuses import RunKind
from hpcserve.deployment.runs import LocalRun
from hpcserve.testing.endpoint import MEMBER_ENV
from hpcserve.testing.harness import wait_until
from hpcserve.testing.member import SLOTS_ENV, TOKEN_DELAY_ENV

pytestmark = [pytest.mark.sandbox]
TOKENS = 60  # a stream of 60 tokens x 50 ms: 3 s, long enough to be cut by the preemption
STREAMS = 6  # clients, each streaming one request after the other (2 slots a replica: a queue forms)


@dataclass
class Stream:
    backend: str  # the replica that sent its first chunk (x-backend)
    status: int | None
    tokens: int = 0
    done: bool = False
    error: str | None = None

    @property
    def broken(self) -> bool:
        return self.status == 200 and (not self.done or self.tokens != TOKENS)


class StreamingClients:
    def __init__(self, url: str, key: str):
        self.url, self.key, self.streams = url, key, []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.loop, daemon=True) for _ in range(STREAMS)]
        for thread in self.threads:
            thread.start()

    def loop(self) -> None:
        body = {"model": "stub", "prompt": "tell me a story", "max_tokens": TOKENS, "stream": True}
        with httpx.Client(timeout=120, trust_env=False, headers={"Authorization": f"Bearer {self.key}"}) as client:
            while not self.stopping.is_set():
                self.streams.append(self.one(client, body))

    def one(self, client: httpx.Client, body: dict) -> Stream:
        try:
            with client.stream("POST", f"{self.url}/v1/completions", json=body) as reply:
                stream = Stream(reply.headers.get("x-backend", ""), reply.status_code)
                for line in reply.iter_lines():
                    if line == "data: [DONE]":
                        stream.done = True
                    elif line.startswith("data: {"):
                        choices = json.loads(line[6:]).get("choices") or [{}]
                        stream.tokens += len(choices[0].get("text") or "")
                if reply.status_code != 200:
                    stream.error = reply.read().decode()[:200]
                return stream
        except (httpx.HTTPError, ValueError) as exc:
            return Stream("", None, error=f"{type(exc).__name__}: {exc}"[:200])

    def stop(self) -> list[Stream]:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=120)
        return self.streams


def scontrol(env: dict, *args: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", *args, "-o"], capture_output=True, text=True, env=env, timeout=30,
                         check=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def preempt(env: dict, job: str) -> str:
    """Another user's job on `high` that needs the burst job's cores on its node: Slurm preempts it."""
    node = scontrol(env, "job", job)["NodeList"]
    fields = scontrol(env, "node", node)
    need = int(fields["CPUTot"]) - int(fields["CPUAlloc"]) + int(scontrol(env, "job", job)["NumCPUs"])
    done = subprocess.run(["sbatch", "--parsable", "-p", "high", "-w", node, f"--cpus-per-task={need}", "--no-requeue",
                           "-t", "2", "-J", "someone-urgent", "-o", "/dev/null", "--wrap", "sleep 120"],
                          capture_output=True, text=True, env=env, timeout=30, check=True)
    return done.stdout.strip().split(";")[0]


def test_a_preempted_burst_replica_hands_its_streams_over_and_is_replaced(slurm_env, tmp_path):
    env = dict(os.environ)
    raw = {"name": "sb-burst", "model": {"path": "builtin:tiny-llama", "served_name": "stub"},
           "cluster": {"scheduler": "slurm", "partition": "debug", "nodes": 1, "cpus_per_node": 1, "gpus_per_node": 0,
                       "time": "10"},
           "engine": {"env": {TOKEN_DELAY_ENV: "50", SLOTS_ENV: "2"}},
           "serve": {"host": "0.0.0.0", "port": free_port(), "api_key_env": "HPCSERVE_API_KEY", "handover": False},
           "autoscale": {"min": 1, "max": 1, "target_queue": 1, "scale_up_after_s": 2, "scale_down_after_s": 600,
                         "burst": {"partition": "scavenger", "max": 1, "signal_s": 20}},
           "results_dir": str(tmp_path / "results")}
    record = LocalRun.start(parse_config(raw), tmp_path, "hpcserve.testing.endpoint", RunKind.ENDPOINT,
                            choose_key("HPCSERVE_API_KEY", False), {MEMBER_ENV: "1"}).record
    state = lambda: read_json(RunPaths(Path(record.run_dir)).state, {}) or {}  # noqa: E731
    seen: dict[tuple, dict] = {}

    def decisions(action: str) -> list[dict]:
        for d in state().get("decisions") or []:
            seen[(d["time"], d["action"], d["reason"])] = d
        return sorted((d for d in seen.values() if d["action"] == action), key=lambda d: d["time"])

    def members() -> dict[str, dict]:
        return {m["name"]: m for m in state().get("members") or []}

    urgent = None
    started = time.monotonic()
    try:
        wait_until(lambda: state().get("status") in ("ready", "failed"), 120, "the endpoint's ready")
        assert state()["status"] == "ready", state().get("error")
        clients = StreamingClients(state()["endpoint"]["url"], env["HPCSERVE_API_KEY"])
        try:
            # The queue rises: autoscale adds the burst replica on scavenger, and it serves streams
            wait_until(lambda: any(m["burst"] and m["status"] == "serving" for m in members().values()), 60,
                       "a burst replica serving", poll_s=0.5)
            burst = next(m for m in members().values() if m["burst"])
            wait_until(lambda: sum(s.backend == burst["name"] for s in clients.streams) >= 2, 30,
                       "streams served by the burst replica", poll_s=0.2)
            preempted_at = time.time()
            urgent = preempt(env, burst["record"]["job_id"])
            wait_until(lambda: decisions("replace preempted"), 30, "the preemption acted on", poll_s=0.2)
            wait_until(lambda: members()[burst["name"]]["status"] == "gone", 60, "the burst member gone", poll_s=0.5)
        finally:
            streams = clients.stop()
        final = state()
    finally:
        if urgent:
            subprocess.run(["scancel", urgent], env=env, timeout=30)
        LocalRun(record).stop(timeout_s=120)
    elapsed = time.monotonic() - started

    failed = [s for s in streams if s.status != 200]
    broken = [s for s in streams if s.broken]
    moved = [d for d in decisions("migrate") if d["time"] >= preempted_at]
    log = "\n".join(f"{d['time'] - preempted_at:+6.1f}s {d['action']}: {d['reason']}"
                    for d in sorted(seen.values(), key=lambda d: d["time"]))
    report = (f"{len(streams)} streams ({sum(s.backend == burst['name'] for s in streams)} begun on the burst "
              f"replica), {len(failed)} failed {[s.error for s in failed][:3]}, {len(broken)} broken, "
              f"{len(moved)} migrated; {elapsed:.0f} s in all\n{log}")
    print(report)
    assert streams and not failed and not broken, report
    # The burst replica was preempted (Slurm's PreemptTime), drained at once: its streams moved
    preempted = decisions("preempted")
    # (by its SIGUSR1, or by its PreemptTime when Slurm's moved job end showed first)
    assert preempted and preempted[0]["reason"].startswith(burst["name"]), report
    assert "preempted by Slurm" in preempted[0]["reason"], report
    assert any("(handover)" in d["reason"] for d in moved), report
    # ... and a replacement asked for: the main partition is at autoscale.max 1, so on scavenger again
    replaced = decisions("replace preempted")[0]["reason"]
    assert replaced.startswith(f"{burst['name']} by ") and "burst partition scavenger" in replaced, report
    scale_up = decisions("scale up")[0]["reason"]
    assert "main partition is at autoscale.max 1" in scale_up, report
    assert {m["name"] for m in final["members"] if m.get("replaces") == burst["name"]}, final["members"]
    wait_until(lambda: squeue_empty(env), 60, "no job left in the queue")
