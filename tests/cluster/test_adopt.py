"""The endpoint outlives its controller and its login node, on the sandbox: real Slurm, Ray,
vLLM (CPU) and hpcserve's own data plane (the router: endpoint/dataplane/). The controller and the
router run on this machine (the "login node"), the replicas in Slurm jobs on the nodes.

One deployment of two replicas, under load through the endpoint throughout:
1. the controller is killed (kill -9): the data plane holds, and `status` tells it as it is (controller
   gone, router serving, replicas serving) with the command that brings control back;
2. the router is killed too (the login node is lost) and stays down a while; `hpcserve adopt` then starts
   a controller that adopts the replica still serving and a new router on the same port with the same
   key. Requests fail only while no router ran.
   Before that, one replica's node died while nothing controlled the endpoint: adoption replaces it;
3. the surviving replica was not restarted: the same job, the same engine process alive on its node;
4. the next node loss is handled as before: the replica leaves within 5 s, no request fails, a
   replacement is launched;
5. an engine crash (kill -9 of a replica's vLLM process on its node) is handled too: the replica leaves
   within 5 s, no request fails, its replacement joins. (Steps 2-5 are the endpoint's self-healing test:
   a node lost, an engine crashed, each replaced while the other replica serves.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers import run_cli, write_config
from test_distributed_serving import deployed, status_of

from hpcserve.testing.harness import wait_until

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]
HERE = Path(__file__).parent
NAME = "sb-adopt"
RATE = 3.0  # requests per second through the endpoint, as in test_endpoint.py


@dataclass(frozen=True)
class Request:
    sent: float  # wall clock
    done: float
    ok: bool
    error: str = ""


class Load:
    """Open loop: a request every 1/rate s whatever the answers (a client that waits for answers would
    send fewer while the endpoint is down), each recorded with wall-clock times. Bounded by stop() and
    by limit_s."""

    def __init__(self, url: str, key: str, limit_s: float = 900, rate: float = RATE):
        self.url, self.key, self.limit_s, self.rate = url, key, limit_s, rate
        self.requests: list[Request] = []
        self.stopped = threading.Event()
        self.client = httpx.Client(timeout=120, trust_env=False)
        self.pool = ThreadPoolExecutor(max_workers=32)
        self.thread = threading.Thread(target=self._schedule, daemon=True)
        self.thread.start()

    def _schedule(self) -> None:
        deadline = time.monotonic() + self.limit_s
        next_at = time.monotonic()
        while not self.stopped.is_set() and time.monotonic() < deadline:
            self.pool.submit(self._one)
            next_at += 1 / self.rate
            self.stopped.wait(max(0.0, next_at - time.monotonic()))

    def _one(self) -> None:
        sent = time.time()
        try:
            reply = self.client.post(f"{self.url}/v1/completions", headers={"Authorization": f"Bearer {self.key}"},
                                     json={"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 16})
            ok, error = reply.status_code == 200, "" if reply.status_code == 200 else f"HTTP {reply.status_code}"
        except httpx.HTTPError as exc:
            ok, error = False, type(exc).__name__
        self.requests.append(Request(sent, time.time(), ok, error))

    def answered(self, count: int, since: float = 0.0, timeout_s: float = 60) -> None:
        """Waits until `count` requests sent at or after `since` (wall clock) are answered, well or not."""
        wait_until(lambda: sum(1 for r in list(self.requests) if r.sent >= since) >= count, timeout_s,
                   f"{count} answers to the load")

    def stop(self) -> list[Request]:
        self.stopped.set()
        self.thread.join()
        self.pool.shutdown(wait=True)
        self.client.close()
        return sorted(self.requests, key=lambda r: r.sent)


def state_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "state.json").read_text())


def replicas_now(name: str) -> dict[str, tuple[str, str, int]]:
    """Serving member -> (job id, node, engine PID), from each member's own run folder."""
    out = {}
    for member in status_of(name)["members"]:
        if member["status"] == "serving":
            replica = state_of(Path(member["run_dir"]))["replicas"][0]
            out[member["name"]] = (member["runner"].split()[1].rstrip(":"), replica["nodes"][0],
                                   replica["processes"][0]["pid"])
    return out


def engine_alive(sandbox, node: str, pid: int) -> bool:
    return subprocess.run([*sandbox.node_exec_argv(node), "kill", "-0", str(pid)], timeout=10).returncode == 0


def decisions_since(name: str, since: float) -> list[dict]:
    return [d for d in status_of(name)["decisions"] if d["time"] >= since]


def wait_router_back(url: str, since: float) -> float:
    """When the endpoint's port answered HTTP again (any answer), polled every 50 ms."""
    def answers() -> float | None:
        try:
            httpx.get(f"{url}/liveness", timeout=1, trust_env=False)
            return time.time()
        except httpx.HTTPError:
            return None
    return wait_until(answers, 300, f"a router answering on {url} after {since}", poll_s=0.05)


def test_endpoint_survives_its_login_node(slurm_env, tmp_path):
    sandbox = slurm_env
    config = write_config(tmp_path / "adopt.yaml", HERE / "sandbox-replicas.yaml", name=NAME,
                          results_dir=str(tmp_path / "results"), serve={"port": 8800})
    with deployed(config, NAME) as status:
        run_dir, url = Path(status["run_dir"]), status["endpoint"]
        before = replicas_now(NAME)
        assert len(before) == 2, status["members"]
        (lost_member, (_, lost_node, _)), (kept, (_, kept_node, _)) = sorted(before.items())
        load = Load(url, os.environ["HPCSERVE_API_KEY"])
        load.answered(6)

        # 1. The controller is killed: the data plane holds; status tells it as it is.
        state = state_of(run_dir)
        os.kill(state["driver_pid"], signal.SIGKILL)
        seen = wait_until(lambda: (s := status_of(NAME))["status"] == "uncontrolled" and s, 30, "status: uncontrolled")
        assert f"router pid {state['endpoint']['pid']} serving" in seen["runner"], seen["runner"]
        assert [r["healthy"] for r in seen["replicas"]] == [True, True], seen["replicas"]
        assert f"hpcserve adopt {NAME}" in seen["advice"]
        assert all(m["status"] == "serving" and "RUNNING" in m["runner"] for m in seen["members"]
                   if m["name"] in before), seen["members"]

        # 2. A replica's node dies while nothing controls the endpoint; then the router is killed too
        # (the login node is lost) and stays down a while; then `hpcserve adopt`.
        sandbox.kill_node(lost_node)
        wait_until(lambda: not all(r["healthy"] for r in status_of(NAME)["replicas"]), 30, "status: a replica down")
        killed = time.time()
        os.killpg(state["endpoint"]["pid"], signal.SIGKILL)
        seen = wait_until(lambda: (s := status_of(NAME))["status"] == "uncontrolled" and "router gone" in s["runner"]
                          and s, 30, "status: uncontrolled, router gone")
        with pytest.raises(httpx.ConnectError):  # gone indeed: nothing listens on the endpoint's port
            httpx.get(f"{url}/liveness", timeout=2, trust_env=False)
        # it stays down until the clients met it down: a request sent after the kill failed
        wait_until(lambda: any(r.sent >= killed and not r.ok for r in list(load.requests)), 30,
                   "a request failed while no router ran")
        healthy = {r["member"]: r["healthy"] for r in seen["replicas"]}
        assert healthy == {kept: True, lost_member: False}, seen["replicas"]
        adopting = time.time()
        done = run_cli("adopt", NAME, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        back = wait_router_back(url, killed)
        load.answered(20, since=back)  # the router back: what clients send now is answered
        requests = load.stop()

        failed = [r for r in requests if not r.ok]
        in_flight = [r for r in failed if r.sent < killed]
        assert all(r.sent < back for r in failed), [(r.sent - killed, r.error) for r in failed if r.sent >= back]
        assert all(r.done >= killed for r in in_flight)  # failed only because the router was killed under it
        after = [r for r in requests if r.sent >= back]
        assert after and all(r.ok for r in after)
        adopted = decisions_since(NAME, adopting)
        actions = {d["action"]: d["reason"] for d in adopted}
        assert [d["action"] for d in adopted].count("adopted") == 1 and kept in actions["adopted"], adopted
        assert lost_member in (actions.get("adopt: lost") or actions.get("adopt: drop") or ""), adopted
        assert "router restarted" in actions, adopted
        print(f"\nFIGURES requests={len(requests)} failed={len(failed)} (in flight at the kill: {len(in_flight)}, "
              f"sent while no router ran: {len(failed) - len(in_flight)}) seconds_without_router={back - killed:.1f} "
              f"(adopt command to router answering: {back - adopting:.1f})")

        # 3. The surviving replica was not restarted: the same job, the same engine process alive on its
        # node. The lost one is replaced as usual.
        assert replicas_now(NAME) == {kept: before[kept]}
        assert engine_alive(sandbox, kept_node, before[kept][2])
        launches = [d for d in adopted if d["action"].startswith("launch")]
        assert launches and all(f"replacing {lost_member}" in d["reason"] for d in launches), launches
        # `status` counts the lost replica (1 of 2 up), also once acknowledged, until a replacement serves
        seen = status_of(NAME)
        assert (seen["status"], seen["up"], seen["total"]) == ("degraded", 1, 2), (seen["status"], seen["lost"])
        assert [x["member"] for x in seen["lost"] if x["counted"]] == [lost_member], seen["lost"]
        acked = run_cli("status", NAME, "--ack")
        assert acked.returncode == 0 and f"acknowledged: {lost_member}" in acked.stderr, acked.stdout + acked.stderr
        assert (status_of(NAME)["up"], status_of(NAME)["total"]) == (1, 2)
        sandbox.start_node(lost_node)
        joined = wait_until(lambda: [d for d in decisions_since(NAME, adopting) if d["action"] == "join"], 420, "join")
        seen = status_of(NAME)
        assert (seen["status"], seen["up"], seen["total"]) == ("ready", 2, 2), (seen["status"], seen["lost"])
        print(f"FIGURES the lost replica's replacement serving {joined[0]['time'] - adopting:.0f} s after adopt")

        # 4. The next node loss is handled as before: out of the pool within 5 s, no request lost, a
        # replacement launched (its join was seen above).
        load = Load(url, os.environ["HPCSERVE_API_KEY"])
        load.answered(6)
        lost = time.time()
        sandbox.kill_node(kept_node)
        leave = wait_until(lambda: [d for d in decisions_since(NAME, lost) if d["action"] == "leave"], 30, "leave")[0]
        assert leave["time"] - lost <= 5.0, leave
        load.answered(20, since=leave["time"])  # the rest of the pool serves what is sent after the leave
        requests = load.stop()
        assert all(r.ok for r in requests), [(r.sent - lost, r.error) for r in requests if not r.ok][:8]
        wait_until(lambda: [d for d in decisions_since(NAME, lost) if d["action"] == "launch replacement"
                            and kept in d["reason"]], 60, "a replacement launched")
        print(f"FIGURES node loss after adoption: left the pool after {leave['time'] - lost:.1f} s, "
              f"{len(requests)} requests, 0 failed")
        sandbox.start_node(kept_node)

        # 5. An engine crash: kill -9 of a serving replica's vLLM process, inside its node, once the
        # replacement of step 4 serves (the other replica keeps the endpoint up).
        wait_until(lambda: len(replicas_now(NAME)) == 2, 420, "two replicas serving again")
        # `status` tells the truth after the replacement: 2 of 2 wanted serve, but a member was lost, and it
        # counts (degraded, 2/3 up) until acknowledged (docs/endpoint.md, "Lost replicas in status")
        seen = status_of(NAME)
        assert (seen["status"], seen["up"], seen["total"]) == ("degraded", 2, 3), (seen["status"], seen["lost"])
        (loss,) = [x for x in seen["lost"] if x["counted"]]
        assert (loss["member"], loss["nodes"], loss["stand_in_status"]) == (kept, [kept_node], "serving"), loss
        assert loss["stand_in"] in replicas_now(NAME), (loss, replicas_now(NAME))
        table = run_cli("status", NAME).stdout
        said = next((line.strip() for line in table.splitlines() if line.strip().startswith("degraded: ")), table)
        assert said.startswith(f"degraded: 2/3 up ({kept} on {kept_node} lost at ") and \
            f", replaced by {loss['stand_in']})" in said and f"status {NAME} --ack" in said, said
        row = next((line.strip() for line in table.splitlines() if line.strip().startswith(f"{NAME} ")), "")
        print(f"FIGURES status after the replacement: {row} / {said}")
        assert run_cli("status", NAME, "--ack").returncode == 0
        seen = status_of(NAME)
        assert (seen["status"], seen["up"], seen["total"]) == ("ready", 2, 2), (seen["status"], seen["lost"])
        victim, (_, node, pid) = sorted(replicas_now(NAME).items())[0]
        load = Load(url, os.environ["HPCSERVE_API_KEY"])
        load.answered(6)
        crashed = time.time()
        subprocess.run([*sandbox.node_exec_argv(node), "kill", "-9", str(pid)], check=True, timeout=10)
        leave = wait_until(lambda: [d for d in decisions_since(NAME, crashed) if d["action"] == "leave"], 30, "leave")[0]
        assert leave["time"] - crashed <= 5.0, leave
        joined = wait_until(lambda: [d for d in decisions_since(NAME, crashed) if d["action"] == "join"], 420, "join")
        requests = load.stop()
        assert all(r.ok for r in requests), [(r.sent - crashed, r.error) for r in requests if not r.ok][:8]
        assert len(replicas_now(NAME)) == 2 and victim not in replicas_now(NAME)
        table = run_cli("status", NAME).stdout
        assert "leave" in table and "launch replacement" in table
        assert f"degraded: 2/3 up ({victim} on {node} lost at " in table, table  # the crash counts too
        print(f"FIGURES engine crash: left the pool after {leave['time'] - crashed:.1f} s, replacement serving "
              f"{joined[0]['time'] - crashed:.0f} s later, {len(requests)} requests, 0 failed")
