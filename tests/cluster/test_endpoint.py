"""One endpoint over many replicas on the sandbox (real Slurm, Ray and vLLM on CPU):

- self-healing (a node lost, an engine killed, each replaced while the other replica serves) is proven
  in tests/cluster/test_adopt.py, together with adopting an endpoint whose controller and router were lost;
- scale with load: the queue rises above target, a Slurm job with one more replica joins; idle, it is
  drained and cancelled; `status` shows every decision with its reason.

The walltime handover is tested in test_handover.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from helpers import HPCSERVE, SMALL_KV_CACHE, write_config
from test_adopt import Load
from test_distributed_serving import deployed, status_of

from hpcserve.engine.metrics import FINISHED, parse_engine_metrics, total
from hpcserve.testing.harness import wait_until

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]
HERE = Path(__file__).parent
BENCH = ["--input-len", "16", "--output-len", "16"]


def start_bench(name: str, out: Path, *load: str) -> subprocess.Popen:
    return subprocess.Popen([*HPCSERVE, "bench", name, *BENCH, *load, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_bench(bench: subprocess.Popen, out: Path, timeout: float = 600) -> list[dict]:
    output, _ = bench.communicate(timeout=timeout)
    assert bench.returncode == 0, output
    return [r for run in json.loads(out.read_text())["runs"] for r in run["requests"]]


INTERRUPTED = "ClientPayloadError"  # the stream had begun (HTTP 200 sent), then its engine died


def retryable_failures(requests: list[dict]) -> list[dict]:
    """Failed without a response begun: a router error (5xx), a refused or reset connection. The
    router can send such a request elsewhere. A stream already begun when its engine died (vLLM
    sends the 200 before the first token) cannot be taken back: those are counted apart."""
    return [r for r in requests if not r["ok"] and INTERRUPTED not in (r["error"] or "")]


def interrupted(requests: list[dict]) -> list[dict]:
    return [r for r in requests if not r["ok"] and INTERRUPTED in (r["error"] or "")]


def errors(requests: list[dict]) -> list[str]:
    return [f"{r['start_s']:.1f}s {r['error']}" for r in requests][:8]


def decisions(name: str) -> list[dict]:
    return status_of(name)["decisions"]


def wait_decision(name: str, action: str, since: float, timeout: float, text: str = "") -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [d for d in decisions(name) if d["action"] == action and d["time"] >= since and text in d["reason"]]
        if found:
            return found[0]
        time.sleep(0.5)
    raise AssertionError(f"no '{action}' decision ({text!r}) within {timeout} s: {decisions(name)}")


def serving_members(name: str) -> list[dict]:
    return [m for m in status_of(name)["members"] if m["status"] == "serving"]


def member_node(member: dict) -> str:
    state = json.loads((Path(member["run_dir"]) / "state.json").read_text())
    return state["replicas"][0]["nodes"][0], state["replicas"][0]["processes"][0]["pid"]


def requests_served(url: str) -> float:
    """Completed requests of one engine: vLLM's own counter."""
    reply = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {os.environ['HPCSERVE_API_KEY']}"},
                      timeout=30)
    reply.raise_for_status()
    return total(parse_engine_metrics(reply.text), FINISHED) or 0.0


def wait_served(name: str, more_than: int, timeout: float = 120) -> None:
    """Until the serving replicas finished `more_than` requests since this was called: the load is on."""
    urls = [u for m in serving_members(name) for u in m["backends"]]
    before = sum(requests_served(u) for u in urls)
    wait_until(lambda: sum(requests_served(u) for u in urls) - before > more_than, timeout,
               f"{more_than} requests served by {urls}")


def test_endpoint_scales_with_the_queue_and_drains_when_idle(slurm_env, tmp_path):
    config = write_config(tmp_path / "scale.yaml", HERE / "sandbox-replicas.yaml", name="sb-scale",
                          results_dir=str(tmp_path / "results"), serve={"port": 8600},
                          parallelism={"tensor": 1, "pipeline": 1, "replicas": 1},
                          engine={"args": ["--enforce-eager", "--max-num-seqs", "2", *SMALL_KV_CACHE]},
                          # Idle for 15 s: the steady load (a request every 2 s) leaves no such gap.
                          autoscale={"min": 1, "max": 2, "target_queue": 2, "scale_up_after_s": 5,
                                     "scale_down_after_s": 15})
    with deployed(config, "sb-scale") as status:
        started = time.time()
        # The ramp: a burst far above one replica's capacity until the controller scales up (a fixed burst
        # ended before the queue had been long for 5 s once the engine answered 240 requests in 11 s), then
        # light steady load while the added replica loads and joins (about a minute here, eager) and a little
        # after, then nothing. (Under a long burst, a second replica needs minutes to load here: both cores are
        # busy with the first one's engine.)
        burst = start_bench("sb-scale", tmp_path / "burst.json", "--concurrency", "12", "--num-prompts", "5000",
                            "--output-len", "32")
        try:
            up = wait_decision("sb-scale", "scale up", started, timeout=120)
        finally:
            burst.terminate()  # its requests are not judged: a client stopped mid-request
            burst.communicate(timeout=60)
        assert "waiting per replica" in up["reason"]
        assert "launch scale-up" in [d["action"] for d in decisions("sb-scale")]
        # Open loop, 0.5 requests/s, until 10 s after the join (a fixed count of 60 ran 80 s past it)
        steady = Load(status["endpoint"], os.environ["HPCSERVE_API_KEY"], rate=0.5)
        try:
            joined = wait_decision("sb-scale", "join", up["time"], timeout=480)
            assert len(serving_members("sb-scale")) == 2
            time.sleep(max(0.0, joined["time"] + 10 - time.time()))  # the load window, not a wait for a state
        finally:
            requests = steady.stop()
        assert requests and all(r.ok for r in requests), [(r.sent - joined["time"], r.error) for r in requests if not r.ok][:3]
        idle = time.time()
        drained = wait_decision("sb-scale", "leave", idle, timeout=120, text="drained")
        assert "idle" in drained["reason"]
        deadline = time.monotonic() + 120
        while len([m for m in status_of("sb-scale")["members"] if m["status"] != "gone"]) > 1:
            assert time.monotonic() < deadline, status_of("sb-scale")["members"]
            time.sleep(1)
        assert status_of("sb-scale")["status"] == "ready"
