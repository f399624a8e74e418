"""The endpoint controller's decisions: leaving the pool, scaling, capacity weights (walltime handover:
test_handover_decisions.py)."""

from __future__ import annotations

from hpcserve.core.config import AutoscaleSpec
from hpcserve.endpoint.control.decisions import (
    SLOW_PROBES_TO_LEAVE,
    LoadSample,
    ProbeResult,
    decide_scale,
    is_suspect,
    leave_reason,
    replace_failed_launch,
    should_leave,
    update_idle_since,
)

SPEC = AutoscaleSpec(min=1, max=3, target_queue=4, scale_up_after_s=10, scale_down_after_s=30)


def samples(waiting_per_backend: float, times: range, backends=("a",)) -> list[LoadSample]:
    return [LoadSample(t, {b: waiting_per_backend for b in backends}, {b: 1.0 for b in backends}) for t in times]


def test_two_failed_probes_in_a_row_leave_the_pool():
    ok, bad = ProbeResult(True), ProbeResult(False, "refused")
    assert not should_leave([ok, bad])
    assert should_leave([ok, bad, bad])
    assert not should_leave([bad, bad, ok])
    assert not should_leave([bad])


def test_a_replica_that_only_answers_late_is_skipped_at_once_and_leaves_much_later():
    # Busy (connected, /health late) is not dead: stopping it would cut the streams it serves.
    ok, late, refused = ProbeResult(True), ProbeResult(False, "SocketTimeoutError", late=True), ProbeResult(False, "refused")
    assert is_suspect([ok, late, late]) and not should_leave([ok, late, late])
    assert not should_leave([ok] + [late] * (SLOW_PROBES_TO_LEAVE - 1))
    assert should_leave([late] * SLOW_PROBES_TO_LEAVE)
    assert f"failed {SLOW_PROBES_TO_LEAVE} probes" in leave_reason([late] * SLOW_PROBES_TO_LEAVE)
    # Late, then refused: dead after all, out at once
    assert should_leave([ok, late, refused]) and not is_suspect([ok, late, refused])
    assert "failed 2 probes" in leave_reason([ok, late, refused])
    assert not is_suspect([late, late, ok])


def test_queue_above_target_for_the_whole_window_adds_a_replica():
    decision = decide_scale(SPEC, samples(6, range(0, 12)), replicas=1, starting=0, idle_since={}, now=11)
    assert decision.action == "up" and "waiting per replica" in decision.reason


def test_requests_the_data_plane_keeps_waiting_count_in_the_queue():
    # Fair share holds a user's excess in the data plane: the engines' own queues stay near empty
    held = [LoadSample(t, {"a": 0.0, "b": 1.0}, {"a": 4.0, "b": 4.0}, queued=11) for t in range(0, 12)]
    decision = decide_scale(SPEC, held, replicas=2, starting=0, idle_since={}, now=11)
    assert decision.action == "up" and "6.0 requests waiting per replica" in decision.reason
    engines_only = [LoadSample(t, {"a": 0.0, "b": 1.0}, {"a": 4.0, "b": 4.0}) for t in range(0, 12)]
    assert decide_scale(SPEC, engines_only, 2, 0, {}, now=11).action == "hold"


def test_a_short_burst_does_not_scale():
    history = samples(1, range(0, 5)) + samples(9, range(5, 12))
    assert decide_scale(SPEC, history, 1, 0, {}, now=11).action == "hold"
    young = samples(9, range(5, 12))  # above target, but observed for less than the window
    assert decide_scale(SPEC, young, 1, 0, {}, now=11).action == "hold"


def test_no_second_scale_up_while_one_is_starting_and_none_past_max():
    history = samples(9, range(0, 12), backends=("a", "b", "c"))
    assert decide_scale(SPEC, history, 1, 1, {}, now=11).action == "hold"
    at_max = decide_scale(SPEC, history, 3, 0, {}, now=11)
    assert at_max.action == "hold" and "autoscale.max 3" in at_max.reason


def test_below_min_scales_up_at_once():
    decision = decide_scale(AutoscaleSpec(min=2, max=3), [], replicas=1, starting=0, idle_since={}, now=0)
    assert decision.action == "up" and "fewer than autoscale.min 2" in decision.reason


def test_the_longest_idle_replica_is_drained_but_never_below_min():
    idle = {"a": 0.0, "b": 5.0}
    down = decide_scale(SPEC, samples(0, range(30, 41), ("a", "b")), 2, 0, idle, now=40)
    assert down.action == "down" and down.backend == "a"
    assert decide_scale(SPEC, samples(0, range(30, 41)), 1, 0, {"a": 0.0}, now=40).action == "hold"


def test_idle_since_resets_when_busy():
    idle = update_idle_since({"a": 1.0, "b": 1.0}, LoadSample(9.0, {"a": 0, "b": 2}, {"a": 0, "b": 0}))
    assert idle == {"a": 1.0, "b": 9.0}
    assert update_idle_since({}, LoadSample(3.0, {"c": 0}, {"c": 0})) == {"c": 3.0}


def test_a_request_finished_between_two_samples_is_not_idleness():
    # Seen on the sandbox: quick requests every few seconds, each done between two samples, and the
    # replica serving them was drained as "idle for 31 s". The finished counter tells.
    before = LoadSample(8.0, {"a": 0, "b": 0}, {"a": 0, "b": 0}, {"a": 40.0, "b": 12.0})
    now = LoadSample(9.0, {"a": 0, "b": 0}, {"a": 0, "b": 0}, {"a": 41.0, "b": 12.0})
    assert update_idle_since({"a": 1.0, "b": 1.0}, now, before) == {"a": 9.0, "b": 1.0}


def test_a_failed_scale_up_or_successor_is_decided_again_not_replaced():
    # Replacing it as well would launch two members where the autoscaler or the handover wants one.
    assert not replace_failed_launch("scale-up")
    assert not replace_failed_launch("successor")
    assert replace_failed_launch("initial") and replace_failed_launch("replacement")
