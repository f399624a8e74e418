"""`hpcserve status` after a replica was lost and replaced: the lost one stays counted ("degraded: 2/3 up
(... lost at ..., replaced by ...)") until the user acknowledges it and a replacement serves in its place,
or a walltime handover renewed that replica (endpoint/status.py: count_replicas, pure). The same on the
sandbox, after a real node kill and its replacement: tests/cluster/test_adopt.py (step 4)."""

from __future__ import annotations

import json

from hpcserve.core.statuses import MemberRole, MemberStatus, RunStatus
from hpcserve.endpoint.control.members import Member
from hpcserve.endpoint.control.status import (
    acknowledge,
    acknowledged,
    count_replicas,
    decide_status,
    lost_line,
)

S, L, G, F, D = (MemberStatus.SERVING, MemberStatus.LAUNCHING, MemberStatus.GONE, MemberStatus.FAILED,
                 MemberStatus.DRAINING)


def member(name: str, status: MemberStatus = S, role: MemberRole = MemberRole.INITIAL, served: bool = True,
           successor: str | None = None, retired: bool = False, launched: float = 100.0, backends=None) -> Member:
    if backends is None:
        backends = [f"http://{name}:8301"] if served else []
    return Member(name, 0, role, {"tensor": 1, "pipeline": 1, "replicas": 1}, {"run_dir": f"/r/{name}"},
                  launched=launched, status=status, backends=backends, ready_s=60.0 if served else None,
                  successor=successor, retired=retired, note=f"{name}'s note")


def pool(members: list[Member], healthy: set[str] | None = None) -> list[dict]:
    """The rows the controller writes (every member with backends), healthy as checked now."""
    return [{"url": u, "member": m.name, "healthy": m.name in (healthy or set()) or
             (healthy is None and m.status is S)} for m in members for u in m.backends]


def count(members: list[Member], acked=(), healthy=None):
    return count_replicas(pool(members, healthy), members, set(acked))


def line(c) -> tuple[int, int]:
    return c.up, c.total


def test_nothing_lost_counts_the_pool_as_before():
    members = [member("m0"), member("m1")]
    c = count(members)
    assert line(c) == (2, 2) and c.losses == [] and decide_status(RunStatus.READY, c) is RunStatus.READY
    c = count(members, healthy={"m0"})  # a replica not answering (not yet left the pool): degraded, as before
    assert line(c) == (1, 2) and decide_status(RunStatus.READY, c) is RunStatus.DEGRADED
    plain = count_replicas([{"url": "u", "healthy": True}], [])  # a deployment without a router
    assert line(plain) == (1, 1)


def test_a_lost_replica_whose_replacement_starts_is_one_of_two_down():
    members = [member("m0"), member("m1", G, successor="m2"), member("m2", L, MemberRole.REPLACEMENT, served=False,
                                                                     launched=200.0)]
    c = count(members)
    assert line(c) == (1, 2) and decide_status(RunStatus.READY, c) is RunStatus.DEGRADED
    (loss,) = c.losses
    assert (loss.member, loss.at, loss.stand_in, loss.stand_in_status, loss.counted) == ("m1", 200.0, "m2", "launching",
                                                                                          True)


def test_replaced_but_not_acknowledged_reads_degraded_two_of_three():
    members = [member("m0"), member("m1", G, successor="m2"), member("m2", S, MemberRole.REPLACEMENT)]
    c = count(members)
    assert line(c) == (2, 3) and decide_status(RunStatus.READY, c) is RunStatus.DEGRADED
    assert [(x.member, x.stand_in, x.stand_in_status, x.counted) for x in c.losses] == [("m1", "m2", "serving", True)]


def test_the_lost_members_row_never_counts_as_up_even_when_its_url_answers_again():
    # the replacement on the same node and slot has the lost one's URL: that URL answers, for the replacement
    lost = member("m1", G, successor="m2")
    members = [member("m0"), lost, member("m2", S, MemberRole.REPLACEMENT, backends=list(lost.backends))]
    c = count(members, healthy={"m0", "m1", "m2"})
    assert line(c) == (2, 3)


def test_acknowledged_and_replaced_is_ready_again():
    members = [member("m0"), member("m1", G, successor="m2"), member("m2", S, MemberRole.REPLACEMENT)]
    c = count(members, acked={"m1"})
    assert line(c) == (2, 2) and decide_status(RunStatus.READY, c) is RunStatus.READY
    assert c.losses[0].acknowledged and not c.losses[0].counted  # still in the JSON, as history


def test_acknowledging_does_not_hide_a_replica_still_missing():
    starting = [member("m0"), member("m1", G, successor="m2"), member("m2", L, MemberRole.REPLACEMENT, served=False)]
    assert line(count(starting, acked={"m1"})) == (1, 2)
    gave_up = [member("m0"), member("m1", G, successor="none")]  # self-healing gave up: never replaced
    c = count(gave_up, acked={"m1"})
    assert line(c) == (1, 2) and c.losses[0].stand_in is None


def test_each_loss_counts_and_an_acknowledged_one_leaves_the_slot_to_the_later_loss():
    # m1 lost, replaced by m2, lost too, replaced by m3 (starting): the slot is missing once, not twice
    members = [member("m0"), member("m1", G, successor="m2"), member("m2", G, MemberRole.REPLACEMENT, successor="m3"),
               member("m3", L, MemberRole.REPLACEMENT, served=False)]
    assert line(count(members)) == (1, 3)  # two losses nobody acknowledged
    assert line(count(members, acked={"m1"})) == (1, 2)
    assert line(count(members, acked={"m1", "m2"})) == (1, 2)
    members[3] = member("m3", S, MemberRole.REPLACEMENT)
    assert line(count(members, acked={"m1", "m2"})) == (2, 2)
    assert line(count(members, acked={"m1"})) == (2, 3)


def test_drained_on_purpose_and_failed_launches_are_no_losses():
    members = [member("m0"),
               member("m1", G, retired=True, backends=[]),  # scaled down / handed over / down --member
               member("m2", F, MemberRole.SCALE_UP, served=False, retired=True),  # never served
               member("m3", F, MemberRole.REPLACEMENT, served=False, successor="m4"),
               member("m4", D, retired=True, backends=[])]
    c = count(members)
    assert line(c) == (1, 1) and c.losses == []


def test_a_walltime_handover_renews_the_lost_replica():
    members = [member("m0"), member("m1", G, successor="m2"),
               member("m2", G, MemberRole.REPLACEMENT, successor="m3", retired=True, backends=[]),  # handed over
               member("m3", L, MemberRole.SUCCESSOR, served=False)]
    assert line(count(members)) == (1, 2)  # the successor does not serve yet
    members[3] = member("m3", S, MemberRole.SUCCESSOR)
    c = count(members)
    assert line(c) == (2, 2) and not c.losses[0].counted


def test_only_ready_turns_degraded():
    c = count([member("m0"), member("m1", G, successor="none")])
    for state in (RunStatus.STARTING, RunStatus.STOPPING, RunStatus.FAILED, RunStatus.DEAD):
        assert decide_status(state, c) is state


def test_the_line_names_the_loss_its_replacement_and_how_to_acknowledge():
    members = [member("m0"), member("m1", G, successor="m2"), member("m2", S, MemberRole.REPLACEMENT)]
    c = count_replicas(pool(members), members, set(), {"m1": ["hsn2"]})
    losses = [json.loads(json.dumps(x.__dict__)) for x in c.losses]
    text = lost_line("sb", "degraded", c.up, c.total, losses)
    assert text.startswith("degraded: 2/3 up (m1 on hsn2 lost at ") and ", replaced by m2)" in text, text
    assert text.endswith("; `hpcserve status sb --ack` once seen"), text
    starting = [member("m0"), member("m1", G, successor="m2"), member("m2", L, MemberRole.REPLACEMENT, served=False)]
    c = count(starting, acked={"m1"})
    text = lost_line("sb", "degraded", c.up, c.total, [x.__dict__ for x in c.losses])
    assert "replacement m2 launching" in text and "--ack" not in text, text
    c = count(members, acked={"m1"})
    assert lost_line("sb", "ready", c.up, c.total, [x.__dict__ for x in c.losses]) is None


def test_ack_writes_the_lost_members_to_the_run_folder(tmp_path):
    members = [member("m0"), member("m1", G, successor="m2"), member("m2", S, MemberRole.REPLACEMENT)]
    (tmp_path / "state.json").write_text(json.dumps({"status": "ready", "members": [m.to_json() for m in members]}))
    record = type("R", (), {"run_dir": str(tmp_path)})()
    assert acknowledged(tmp_path) == set()
    assert acknowledge(record) == ["m1"] and acknowledged(tmp_path) == {"m1"}
    assert acknowledge(record) == []  # nothing new
