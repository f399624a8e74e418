"""A stream whose replica must go while no other serves waits for the next replica and continues there
(endpoint/dataplane/successor.py), through the real data plane process in front of the migration stand-in
engines (test_streams.Engines: vLLM 0.32's token ids). Without a successor within the hold, the client
gets an SSE error event and [DONE], not a cut."""

from __future__ import annotations

import json
import threading

import pytest
from helpers import free_port
from router_fixtures import key_file
from test_migration import client_body, events_of, summary, uninterrupted
from test_streams import Engines, client_stream

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.control.plane_client import Router
from hpcserve.endpoint.dataplane import migration as m
from hpcserve.endpoint.dataplane.successor import wait_limit
from hpcserve.endpoint.protocol import WakePhase, Waking
from hpcserve.testing.harness import wait_until

HOLD_S = 4.0


@pytest.fixture(scope="module")
def engines():
    stand_ins = Engines()
    yield stand_ins
    stand_ins.close()


@pytest.fixture
def plane(engines, tmp_path):
    router = Router("127.0.0.1", free_port(), key_file(tmp_path), tmp_path / "router.log", policy=Routing.ROUND_ROBIN,
                    admin_socket=tmp_path / "admin" / "admin.sock", hold_s=HOLD_S)
    router.start(engines.urls[:1])  # one replica serves
    yield router
    router.stop()
    router.close()


def stream_in_thread(plane: Router, body: dict) -> tuple[threading.Thread, dict]:
    got: dict = {}
    reader = threading.Thread(target=lambda: got.update(raw=client_stream(plane, m.Kind.COMPLETION, body)))
    reader.start()
    return reader, got


def without_comments(raw: bytes) -> bytes:
    """The stream as an SSE client reads it: comment lines (": ...") ignored."""
    return b"".join(e for e in events_of(raw) if not e.startswith(b":"))


def held(plane: Router) -> int:
    return int(plane.backends_json().get("held") or 0)


def test_the_wait_is_the_hold_or_the_wake_wait_of_a_model_at_zero():
    waking = Waking(WakePhase.QUEUED, 0.0, 600.0)
    assert wait_limit(60.0, None, False) == (60.0, "hold_s")
    assert wait_limit(60.0, waking, False) == (600.0, "autoscale.wake_wait_s")
    assert wait_limit(60.0, waking, True) == (60.0, "hold_s")  # replicas in the pool: the ordinary hold


def test_a_handed_over_stream_waits_for_a_late_successor_and_continues_there(engines, plane):
    engines.failure, engines.after, engines.stalled = "stall", 5, None
    body = client_body(m.Kind.COMPLETION)
    reader, got = stream_in_thread(plane, body)
    try:
        wait_until(lambda: engines.stalled is not None, 10, "the engine stalled mid-stream")
        plane.remove(engines.urls[0], drain_s=0, hand_over=True)  # its job ends: no other replica serves
        wait_until(lambda: held(plane) == 1, 10, "the stream waits for a successor, held")
        assert plane.in_flight(engines.urls[0]) == 0  # the leaving replica's drain does not wait for it
        threading.Timer(1.0, plane.add, args=(engines.urls[1],)).start()  # a successor joins late
        reader.join(20)
        assert not reader.is_alive(), "the stream did not continue on the successor"
    finally:
        engines.release_stall()
        reader.join(20)
    raw = got["raw"]
    assert b": waiting for a replica" in raw  # the connection kept alive meanwhile
    want, have = uninterrupted(m.Kind.COMPLETION, body), summary(without_comments(raw), m.Kind.COMPLETION)
    assert {k: have[k] for k in ("text", "ids", "finish", "done")} == {k: want[k] for k in ("text", "ids", "finish", "done")}
    assert len(have["heads"]) == 1  # one stream, nothing twice
    moved = plane.migrations(0)
    assert [(x["cause"], x["from"], x["to"]) for x in moved] == [("handover", engines.urls[0], engines.urls[1])]
    assert held(plane) == 0


def test_without_a_successor_within_the_hold_the_stream_ends_with_an_error_event(engines, plane):
    engines.failure, engines.after, engines.stalled = "stall", 5, None
    reader, got = stream_in_thread(plane, client_body(m.Kind.COMPLETION))
    try:
        wait_until(lambda: engines.stalled is not None, 10, "the engine stalled mid-stream")
        plane.remove(engines.urls[0], drain_s=0, hand_over=True)
        reader.join(HOLD_S + 15)
        assert not reader.is_alive()
    finally:
        engines.release_stall()
        reader.join(20)
    raw = got["raw"]
    assert not raw.endswith(b"<cut>"), "cut silently"
    events = [e for e in events_of(raw) if e.startswith(b"data: ")]
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "no_replica" and f"within {HOLD_S:g} s" in error["message"]
    assert events[-1] == b"data: [DONE]\n\n"
    moved = plane.migrations(0)
    assert [(x["cause"], x["to"]) for x in moved] == [("handover", None)]
    assert "no replica joined" in moved[0]["reason"]
