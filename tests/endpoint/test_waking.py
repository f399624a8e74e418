"""A model that sleeps (autoscale.min 0) in the data plane (endpoint/dataplane/waking.py): a real data plane
process (two workers, as on a login node) with no replica, told by PUT /waking what its controller would
tell it. A request is held and its arrival returns the controller's long poll at once (GET /waking); a
replica joining answers it, a stream got SSE comments first and its answer in the same stream; a wait
that would pass the limit gets 503 with Retry-After and the reason (Slurm's pending reason, its expected
start); /v1/models says asleep / waking / serving. The controller's side: test_sleep_standin.py; the
decisions, pure, below."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from helpers import free_port
from router_fixtures import headers, key_file, start_stubs, stop

from hpcserve.core.config import AutoscaleSpec
from hpcserve.endpoint.control.decisions import (
    LoadSample,
    PlaneLoad,
    decide_scale,
    decide_sleep,
    decide_wake,
    wake_state,
)
from hpcserve.endpoint.control.plane_client import Router
from hpcserve.endpoint.dataplane.waking import comment, wake_refusal
from hpcserve.endpoint.protocol import Waking, WakePhase
from hpcserve.slurm.states import JobInfo, JobState
from hpcserve.testing.harness import wait_until

HTTP = httpx.Client(timeout=30, trust_env=False)
BODY = {"model": "alpha", "prompt": "Hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    directory = tmp_path_factory.mktemp("waking")
    (stub, url), = start_stubs(["a1"], directory, token_delay_ms=0)
    router = Router("127.0.0.1", free_port(), key_file(directory), directory / "plane.log", model="alpha",
                    admin_socket=directory / "plane" / "admin.sock", workers=2)
    try:
        router.start([])
        yield router, url
    finally:
        router.stop()
        router.close()
        stop(stub)


def asleep(router: Router, wait_s: float = 30.0, **fields) -> None:
    router.apply(remove=[b.url for b in router.backends()])
    router.set_waking(Waking(WakePhase.ASLEEP, time.time(), wait_s, **fields))


def card(router: Router) -> dict:
    return HTTP.get(f"{router.url}/v1/models/alpha", headers=headers()).json()


def test_a_request_for_a_sleeping_model_is_held_signalled_and_answered_once_a_replica_joins(plane):
    router, url = plane
    asleep(router)
    assert card(router)["state"] == "asleep"
    before = router.wakes().asked
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(HTTP.post(f"{router.url}/v1/completions", json=BODY,
                                                                      headers=headers())))
    started = time.monotonic()
    thread.start()
    wakes = router.wakes(before, wait_s=20)  # the long poll returns as the request arrives, not after 20 s
    assert wakes.asked == before + 1 and time.monotonic() - started < 5
    wait_until(lambda: router.wakes().held == 1, 10, "the request held")
    router.set_waking(Waking(WakePhase.STARTING, time.time(), 30.0, member="alpha-m1"))
    assert card(router)["state"] == "waking" and card(router)["waking"].startswith("engine starting")
    router.add(url)
    router.set_waking(Waking(WakePhase.SERVING, time.time(), 30.0))
    thread.join(20)
    assert answers and answers[0].status_code == 200 and answers[0].json()["choices"][0]["text"], answers
    assert card(router)["state"] == "serving"


def test_a_stream_gets_sse_comments_while_it_waits_then_its_answer_in_the_same_stream(plane):
    router, url = plane
    asleep(router)
    router.set_waking(Waking(WakePhase.QUEUED, time.time() - 12, 30.0, reason="Resources", member="alpha-m2"))
    lines: list[str] = []
    comment_seen = threading.Event()

    def read() -> None:
        with HTTP.stream("POST", f"{router.url}/v1/completions", json={**BODY, "stream": True},
                         headers=headers()) as response:
            lines.append(str(response.status_code))
            for line in response.iter_lines():
                lines.append(line)
                if line.startswith(": waking"):
                    comment_seen.set()

    thread = threading.Thread(target=read)
    thread.start()
    assert comment_seen.wait(10), lines
    router.add(url)
    thread.join(20)
    assert lines[0] == "200" and lines[1].startswith(": waking model alpha (queued 1"), lines[:3]
    assert "(Resources)" in lines[1]
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text


def test_a_wait_past_the_limit_gets_503_with_retry_after_and_slurms_reason(plane):
    router, _ = plane
    asleep(router, wait_s=0.5)
    started = time.monotonic()
    late = HTTP.post(f"{router.url}/v1/completions", json=BODY, headers=headers())
    assert late.status_code == 503 and 0.4 < time.monotonic() - started < 5
    assert int(late.headers["Retry-After"]) >= 1
    error = late.json()["error"]
    assert error["code"] == "model_waking" and "no replica woke within 0.5 s" in error["message"]

    # Slurm expects the job to start in an hour: refused at once, with its reason and when it should serve
    router.set_waking(Waking(WakePhase.QUEUED, time.time(), 60.0, reason="Priority", ready_at=time.time() + 3600))
    started = time.monotonic()
    early = HTTP.post(f"{router.url}/v1/completions", json={**BODY, "stream": True}, headers=headers())
    assert early.status_code == 503 and time.monotonic() - started < 2
    assert 3500 < int(early.headers["Retry-After"]) <= 3600
    assert "queued 0 s (Priority)" in early.json()["error"]["message"]


# ---------------------------------------------------------------- the decisions, pure

SPEC = AutoscaleSpec(min=0, max=2, idle_s=300, scale_down_after_s=60, wake_wait_s=120)


def test_the_last_replica_sleeps_after_idle_s_only_with_nothing_in_flight_or_held():
    samples = [LoadSample(0.0, {"u": 0.0}, {"u": 0.0})]
    idle = {"u": 0.0}
    assert decide_scale(SPEC, samples, 1, 0, idle, 100.0, PlaneLoad(0, 0)).action == "hold"  # < idle_s
    asleep_now = decide_scale(SPEC, samples, 1, 0, idle, 301.0, PlaneLoad(0, 0))
    assert asleep_now.action == "sleep" and asleep_now.backend == "u" and "autoscale.idle_s 300" in asleep_now.reason
    held = decide_scale(SPEC, samples, 1, 0, idle, 301.0, PlaneLoad(0, 2))
    assert held.action == "hold" and "2 held" in held.reason
    assert decide_sleep(SPEC, "u", 301.0, None).action == "hold"
    # two replicas: the first goes by scale_down_after_s, as with min >= 1
    two = decide_scale(SPEC, samples, 2, 0, {"u": 0.0, "v": 50.0}, 61.0)
    assert two.action == "down" and two.backend == "u"
    # min 1: the last replica never goes
    assert decide_scale(AutoscaleSpec(min=1), samples, 1, 0, idle, 10_000.0).action == "hold"


def test_a_request_wakes_a_sleeping_model_once():
    assert decide_wake(SPEC, 0, 0, 1, 0).action == "wake"
    assert decide_wake(SPEC, 0, 0, 0, 3).action == "wake"  # held after a failed launch
    assert decide_wake(SPEC, 0, 1, 5, 5).action == "hold"  # one is starting already
    assert decide_wake(SPEC, 1, 0, 5, 5).action == "hold"
    assert decide_wake(SPEC, 0, 0, 0, 0).action == "hold"
    assert decide_wake(AutoscaleSpec(min=1), 0, 0, 1, 1).action == "hold"


def test_the_wake_state_from_slurm_and_the_refusal_it_makes():
    pending = JobInfo("12", JobState.PENDING, reason="Resources", start_time="2030-01-01T10:00:00")
    queued = wake_state(120, False, ("m3", 100.0), pending, 50.0, 0.0, 110.0)
    assert queued.phase is WakePhase.QUEUED and queued.reason == "Resources" and queued.since == 100.0
    assert queued.ready_at is not None and queued.ready_at > 1.8e9  # Slurm's start + the measured startup
    assert queued.describe(112.0) == "queued 12 s (Resources)"
    local = wake_state(120, False, ("m3", 100.0), None, None, 0.0, 110.0)
    assert local.phase is WakePhase.STARTING and local.ready_at is None and local.describe(140.0) == "engine starting 40 s"
    assert wake_state(120, False, None, None, None, 5.0, 110.0).phase is WakePhase.ASLEEP
    assert wake_state(120, True, None, None, None, 5.0, 110.0).phase is WakePhase.SERVING
    assert wake_refusal(local, "m", 110.0, 230.0) is None  # within its wait, nothing known against it
    retry, body = wake_refusal(queued, "m", 110.0, 230.0)
    assert retry > 1000 and b"model_waking" in body and b"Resources" in body
    assert comment("m", local, 112.0) == b": waking model m (engine starting 12 s)\n\n"
