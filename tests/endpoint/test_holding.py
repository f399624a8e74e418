"""`status` says what clients get while no replica takes requests: holding.

The real endpoint process (router's data plane, controller) over stand-in members that take 8 s to serve:
the only replica's stand-in is killed, so the pool is empty until its replacement serves, and a client's
request is held meanwhile (what a walltime handover whose successor is late does too: the old member is
drained at its job's end, the successor still loads). `status` said `ready` (or `degraded`) then; it must
say `holding`, with the request held now, the member it waits for and since when, and no longer once the
replacement serves (the held request then answered). The same on the sandbox with real Slurm jobs, Ray and
vLLM would take minutes: what is judged here is `status` against the real data plane's GET /backends.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import yaml
from helpers import free_port, run_cli

from hpcserve import api
from hpcserve.core.config import parse_config
from hpcserve.core.keys import choose_key
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import forget, save_record
from hpcserve.core.runstate import RunState
from hpcserve.core.statuses import RunKind
from hpcserve.deployment.runs import LocalRun
from hpcserve.endpoint.control.holding import describe, holding
from hpcserve.testing.endpoint import FARM_ENV, READY_AFTER_ENV
from hpcserve.testing.harness import ports_to_listen_on, spawn, stop, wait_until
from hpcserve.testing.members import FarmClient

NAME = "st-holding"
KEY = "holding-test-key"
STARTUP_S = 8.0


def test_status_says_holding_with_the_member_waited_for_and_since_when(hpcserve_home, tmp_path, monkeypatch):
    *ports, admin = ports_to_listen_on(3)
    farm_proc = spawn([sys.executable, "-m", "hpcserve.testing.standin", "--ports", ",".join(map(str, ports)),
                       "--admin-port", str(admin)], tmp_path / "farm.log")
    farm = FarmClient(f"http://127.0.0.1:{admin}")
    record = None
    try:
        wait_until(lambda: len(farm.describe()["standins"]) == 2, 60, "the farm")
        farm.act("stop", ports)  # members start theirs
        monkeypatch.setenv("HPCSERVE_HOLDING_KEY", KEY)
        raw = {"name": NAME, "model": {"path": "builtin:tiny-llama", "served_name": "stub"},
               "cluster": {"scheduler": "local"}, "parallelism": {"replicas": 1},
               "serve": {"port": free_port(), "api_key_env": "HPCSERVE_HOLDING_KEY", "hold_s": 60}}
        (tmp_path / "endpoint.yaml").write_text(yaml.safe_dump(raw))
        record = LocalRun.start(parse_config(raw), tmp_path, "hpcserve.testing.endpoint", RunKind.ENDPOINT,
                                choose_key("HPCSERVE_HOLDING_KEY", False),
                                {FARM_ENV: farm.admin_url, READY_AFTER_ENV: str(STARTUP_S)}).record
        save_record(record)  # `status NAME` finds it, as `up` registers it
        state = lambda: RunState.read(record.run_dir)
        wait_until(lambda: state().status in ("ready", "failed"), 120, "the endpoint")
        serving = api.status(NAME)[0].to_json()
        assert serving["status"] == "ready" and not serving.get("holding"), serving

        victim = state().replicas[0]["url"]
        killed = time.time()
        farm.act("kill", [int(victim.rsplit(":", 1)[1])])
        wait_until(lambda: [d for d in state().decisions if d.action == "leave" and d.time >= killed], 20,
                   "the killed replica out of the pool")
        answers: list[int] = []
        held = threading.Thread(target=lambda: answers.append(completion(state().endpoint_url)), daemon=True)
        held.start()
        admin = RunPaths(Path(record.run_dir)).router_admin
        wait_until(lambda: plane(admin)["held"] == 1 and not plane(admin)["backends"], 10,
                   "the data plane holding the request, no backend")
        row = api.status(NAME)[0].to_json()
        assert row["status"] == "holding", (row["status"], row["replicas"])
        hold = row["holding"]
        assert hold["held"] == 1, hold
        assert [(m["role"], m["name"]) for m in hold["waiting_for"]] == [
            ("replacement", next(m["name"] for m in row["members"] if m["status"] == "launching"))]
        assert killed <= hold["since"] <= time.time() and hold["hold_s"] == 60 and hold["backends"] == 0
        shown = run_cli("status", NAME)
        assert shown.returncode == 0, shown.stderr
        line = next(line for line in shown.stdout.splitlines() if "holding 1 request(s) since" in line)
        assert hold["waiting_for"][0]["name"] in line and "[replacement]" in line and "then 503" in line, line
        print(f"\nFIGURES {line.strip()}")

        held.join(timeout=60)
        assert answers == [200]  # held, then answered by the replacement
        back = wait_until(lambda: served_row(), 10, "status: no longer holding, once the replacement serves")
        # (the lost member's replica stays listed as DOWN, so this reads `degraded`)
        assert back["status"] in ("ready", "degraded") and not back["holding"], back
    finally:
        if record is not None:
            LocalRun(record).stop(timeout_s=60)
            forget(NAME)
        stop(farm_proc)


def served_row() -> dict | None:
    row = api.status(NAME)[0].to_json()
    return row if row["status"] != "holding" and any(m["status"] == "serving" for m in row["members"]) else None


def plane(admin_socket: Path) -> dict:
    """The data plane's GET /backends, on its admin socket (the owner's)."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(admin_socket)), trust_env=False, timeout=5) as client:
        return client.get("http://router/backends").raise_for_status().json()


def completion(endpoint: str) -> int:
    return httpx.post(f"{endpoint}/v1/completions", json={"model": "stub", "prompt": "hi", "max_tokens": 2},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=90, trust_env=False).status_code


# ---------------------------------------------------------------- the decision, pure

def test_a_backend_that_takes_requests_is_not_holding():
    answer = {"held": 0, "hold_s": 60, "backends": [{"url": "u1", "failed": True}, {"url": "u2", "failed": False}]}
    assert holding(answer, [], []) is None


def test_failing_backends_hold_too_and_since_is_the_leave_after_the_last_join():
    members = [{"name": "m0", "role": "initial", "status": "gone", "runner": "job 7"},
               {"name": "m1", "role": "successor", "status": "launching", "runner": "job 9", "note": "Resources"}]
    decisions = [{"time": 10.0, "action": "leave", "reason": "old"}, {"time": 20.0, "action": "join", "reason": "m0"},
                 {"time": 30.0, "action": "leave", "reason": "m0 drained"}, {"time": 31.0, "action": "successor late"}]
    hold = holding({"held": 3, "hold_s": 60, "backends": []}, members, decisions)
    assert hold == {"held": 3, "hold_s": 60, "backends": 0, "since": 30.0,
                    "waiting_for": [{"name": "m1", "role": "successor", "runner": "job 9", "note": "Resources"}]}
    line = describe(hold, now=70.0)
    assert line.startswith("holding 3 request(s) since ") and "(40 s)" in line
    assert line.endswith("each is held up to 60 s, then 503; waiting for m1 [successor]: job 9 (Resources)")
    failing = holding({"held": 1, "backends": [{"url": "u1", "failed": True}]}, [], decisions[:2])
    assert failing["since"] is None and describe(failing).endswith("no member is launching to serve next")
