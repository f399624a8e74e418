"""Scale to zero and wake on request, end to end in local mode: the real endpoint process (data plane,
controller) whose members are local processes running a stand-in engine (hpcserve.testing.member, as
HPCSERVE_STANDIN_MEMBER runs them), with autoscale.min 0. Idle for idle_s: the member is drained and its
process ends, the endpoint answers on (/v1/models: asleep); a request wakes it (a new member process) and
gets a real answer; a stream gets SSE comments, then its answer; requests that arrive while the model goes
to sleep all succeed. The data plane's side alone: test_waking.py."""

from __future__ import annotations

import json
import threading
import time

import psutil
import pytest
import zero_endpoint
from zero_endpoint import BODY, HTTP, decisions, endpoint_at_zero, state

from hpcserve import api
from hpcserve.testing.harness import wait_until

NAME = "st-sleep"
KEY = "sleep-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    with endpoint_at_zero(tmp_path_factory.mktemp("sleep"), NAME, "HPCSERVE_SLEEP_KEY", KEY) as running:
        yield running


def model_state(url: str) -> str:
    return zero_endpoint.model_state(url, HEADERS)


def sleeping(record, url: str, since: float) -> None:
    """Until the model slept (decided after since) and every member's process is gone."""
    wait_until(lambda: decisions(record, "sleep", since), 30, "the sleep decision")
    wait_until(lambda: all(not psutil.pid_exists(m["record"]["driver_pid"]) or
                           psutil.Process(m["record"]["driver_pid"]).status() == psutil.STATUS_ZOMBIE
                           for m in state(record).members), 30, "every member's process gone")
    wait_until(lambda: model_state(url) == "asleep", 10, "/v1/models: asleep")
    row = api.status(NAME)[0]
    assert row.status == "asleep" and row.sleep.startswith("asleep since "), (row.status, row.sleep)


def test_an_idle_model_sleeps_and_a_request_wakes_it(endpoint):
    record, url = endpoint
    started = time.time()
    sleeping(record, url, 0.0)
    assert "no request in flight or held" in decisions(record, "sleep")[-1].reason
    # engine.sleep_mode auto: its engine was asked to sleep; the stand-in has no /sleep (404, as vLLM on CPU)
    wait_until(lambda: decisions(record, "stop"), 10, "the stop decision")
    assert "its engine cannot sleep" in decisions(record, "stop")[-1].reason
    answer = HTTP.post(f"{url}/v1/completions", json=BODY, headers=HEADERS)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"], answer.text
    wake = decisions(record, "wake", started)
    assert wake and "request(s) for the sleeping model" in wake[-1].reason
    assert state(record).sleep["phase"] in ("serving", "starting")
    assert api.status(NAME)[0].status in ("ready", "waking")
    print(f"\nFIGURES woke and answered after the sleep in {time.time() - wake[-1].time:.1f} s")


def test_a_stream_gets_sse_comments_then_its_answer(endpoint):
    record, url = endpoint
    sleeping(record, url, time.time() - 1)
    lines: list[str] = []
    with HTTP.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True}, headers=HEADERS) as response:
        assert response.status_code == 200
        lines = list(response.iter_lines())
    assert lines[0].startswith(": waking model stub ("), lines[:3]
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])


def test_requests_arriving_while_the_model_goes_to_sleep_all_succeed(endpoint):
    record, url = endpoint
    since = time.time()
    # As soon as the sleep is decided (its replica out of the data plane, its process stopping), a burst
    wait_until(lambda: decisions(record, "sleep", since), 30, "the sleep decision", poll_s=0.02)
    codes: list[int] = []
    threads = [threading.Thread(target=lambda: codes.append(HTTP.post(f"{url}/v1/completions", json=BODY,
                                                                      headers=HEADERS).status_code))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert codes == [200] * 8
