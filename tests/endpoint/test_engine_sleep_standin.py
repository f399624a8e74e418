"""Sleep instead of stop, end to end in local mode: the real endpoint process whose member is a local stand-in
engine with vLLM's sleep routes (STANDIN_SLEEP=1: POST /sleep, POST /wake_up, GET /is_sleeping; completions
refused while asleep). Idle for idle_s: its engine is put to sleep in its allocation (the member process
lives on), the model is asleep; a request wakes it with POST /wake_up (no new member) and gets its answer;
after release_after_s asleep the allocation is released (the process ends). The stop path (a stand-in
without the routes answers 404, as vLLM on CPU does): test_sleep_standin.py."""

from __future__ import annotations

import time

import psutil
import pytest
import zero_endpoint
from zero_endpoint import BODY, HTTP, decisions, endpoint_at_zero, state

from hpcserve.testing.harness import wait_until
from hpcserve.testing.member import SLEEP_ENV

NAME = "st-engine-sleep"
KEY = "engine-sleep-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
RELEASE_AFTER_S = 6


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    with endpoint_at_zero(tmp_path_factory.mktemp("engine-sleep"), NAME, "HPCSERVE_ENGINE_SLEEP_KEY", KEY,
                          autoscale={"release_after_s": RELEASE_AFTER_S}, engine={"env": {SLEEP_ENV: "1"}}) as running:
        yield running


def model_state(url: str) -> str:
    return zero_endpoint.model_state(url, HEADERS)


def alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def test_an_idle_engine_sleeps_in_its_allocation_and_a_request_wakes_it(endpoint):
    record, url = endpoint
    wait_until(lambda: decisions(record, "sleep engine"), 30, "the engine put to sleep")
    assert "its engine sleeps" in decisions(record, "sleep engine")[-1].reason
    assert not decisions(record, "stop")
    member = state(record).members[0]
    assert member["status"] == "sleeping" and alive(member["record"]["driver_pid"])  # the allocation kept
    engine = member["backends"][0]
    assert HTTP.get(f"{engine}/is_sleeping", headers=HEADERS).json() == {"is_sleeping": True}
    wait_until(lambda: model_state(url) == "asleep", 10, "/v1/models: asleep")
    asked = time.time()
    answer = HTTP.post(f"{url}/v1/completions", json=BODY, headers=HEADERS)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"], answer.text
    wait_until(lambda: decisions(record, "wake up", asked), 10, "the wake-up decision on record")
    assert not decisions(record, "wake", asked)  # no new job
    assert len(state(record).members) == 1  # woken, not a new member
    assert HTTP.get(f"{engine}/is_sleeping", headers=HEADERS).json() == {"is_sleeping": False}
    print(f"\nFIGURES woken and answered in {time.time() - asked:.2f} s")


def test_a_replica_asleep_past_release_after_s_gives_its_allocation_back(endpoint):
    record, url = endpoint
    since = time.time()
    wait_until(lambda: decisions(record, "sleep engine", since), 30, "asleep again")
    pid = state(record).members[0]["record"]["driver_pid"]
    wait_until(lambda: decisions(record, "release", since), RELEASE_AFTER_S + 20, "the release")
    assert "autoscale.release_after_s" in decisions(record, "release", since)[-1].reason
    wait_until(lambda: not alive(pid), 30, "the member's process gone")
    answer = HTTP.post(f"{url}/v1/completions", json=BODY, headers=HEADERS)  # a new replica then
    assert answer.status_code == 200, answer.text
    wait_until(lambda: decisions(record, "wake", since), 10, "a new replica's wake on record")
    assert len(state(record).members) == 2
