"""`hpcserve down NAME --member M`, the pure and file parts (endpoint/control/policies/member_requests.py): what the command
refuses and why, and what the controller's policy does with a request. The whole path on Slurm, a stream
handed over: tests/cluster/test_two_replicas.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from hpcserve.core.errors import UsageError
from hpcserve.core.runstate import RunStateWriter
from hpcserve.core.statuses import MemberStatus, RunStatus
from hpcserve.endpoint.control.policies.member_requests import MemberRequests, ask_retire, pending, retire


def endpoint_dir(tmp_path, status=RunStatus.READY):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700, parents=True)
    RunStateWriter(run_dir).update(status=status, members=[{"name": "e-m0", "status": "serving"},
                                                           {"name": "e-m1", "status": "gone"}])
    return run_dir


def test_the_command_names_what_is_wrong(tmp_path):
    run_dir = endpoint_dir(tmp_path)
    with pytest.raises(UsageError, match="no member 'e-m7'; its members: e-m0, e-m1"):
        retire(run_dir, "e-m7", timeout_s=1)
    assert retire(run_dir, "e-m1", timeout_s=1) is MemberStatus.GONE  # gone already: nothing to wait for
    starting = endpoint_dir(tmp_path / "b", RunStatus.STARTING)
    with pytest.raises(UsageError, match="starting, not ready"):
        retire(starting, "e-m0", timeout_s=1)
    assert pending(starting) == []  # a refused command leaves no request behind


@dataclass
class Member:
    name: str
    status: MemberStatus
    backends: list[str] = field(default_factory=list)
    retired: bool = False


@dataclass
class Control:
    members: list[Member]
    drained: list = field(default_factory=list)
    stopped: list = field(default_factory=list)
    decided: list = field(default_factory=list)

    def drain_all(self, backends):
        self.drained += backends

    def stop_member(self, member, why):
        self.stopped.append((member.name, why))

    def decide(self, action, reason):
        self.decided.append((action, reason))


def test_the_controller_drains_a_serving_member_and_stops_a_launching_one_once(tmp_path):
    run_dir = endpoint_dir(tmp_path)
    ctl = Control([Member("e-m0", MemberStatus.SERVING, ["http://n1:8001"]), Member("e-m1", MemberStatus.LAUNCHING),
                   Member("e-m2", MemberStatus.GONE)])
    for name in ("e-m0", "e-m1", "e-m2"):
        ask_retire(run_dir, name)
    policy = MemberRequests(run_dir)
    policy.step(ctl)
    assert ctl.drained == [("http://n1:8001", "taken down (down --member)")]  # its streams move with the drain
    assert ctl.stopped == [("e-m1", "taken down (down --member)")] and ctl.members[1].retired  # not replaced
    assert [a for a, _ in ctl.decided] == ["down member"] * 3 and "not running" in ctl.decided[2][1]
    policy.step(ctl)
    assert len(ctl.decided) == 3 and pending(run_dir) == []  # each request carried out once
