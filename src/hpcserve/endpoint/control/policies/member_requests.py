"""`hpcserve down NAME --member MEMBER`: one member of an endpoint taken out while the others serve.

The command leaves a request in the endpoint's run folder (RUN_DIR/requests, owner-only); the controller's
next round drains that member: no new requests, its open streams continued on the other replicas
(endpoint/dataplane/streams.py), stopped once nothing runs on it, and not replaced (retired).

    retire(run_dir, "sb-m1", 210)     # the command's side: asks, then waits until the member is gone
    MemberRequests(run_dir)           # a controller policy: carries out what was asked, once
"""

from __future__ import annotations

import time
from pathlib import Path

from hpcserve.core.errors import UsageError
from hpcserve.core.folders import private_dir
from hpcserve.core.runstate import RunState
from hpcserve.core.statuses import MemberStatus, RunStatus
from hpcserve.endpoint.control.policies.base import ControlPlane

FOLDER = "requests"
PREFIX = "retire-"
# The controller's drain (120 s at most) and a member's stop (60 s at most), with a round to spare
MEMBER_DOWN_TIMEOUT_S = 210.0


def ask_retire(run_dir: Path, member: str) -> Path:
    path = private_dir(Path(run_dir) / FOLDER) / f"{PREFIX}{member}"
    path.touch(mode=0o600)
    return path


def member_status(run_dir: Path, member: str) -> MemberStatus | None:
    for line in RunState.read(Path(run_dir)).members:
        if line.get("name") == member:
            return MemberStatus(line["status"])
    return None


def retire(run_dir: Path, member: str, timeout_s: float, poll_s: float = 0.5) -> MemberStatus | None:
    """Ask the endpoint's controller to take `member` out, and wait until it is stopped (its status then;
    None once state.json no longer lists it);
    UsageError when there is no such member or no controller runs to do it."""
    state = RunState.read(Path(run_dir))
    names = [str(line["name"]) for line in state.members if line.get("name") is not None]
    if member not in names:
        raise UsageError(f"the endpoint has no member {member!r}; its members: {', '.join(names) or 'none'} "
                         "(`hpcserve status NAME` lists them)")
    if state.status is not RunStatus.READY:
        raise UsageError(f"the endpoint is {state.status}, not ready: its controller takes a member out only "
                         "while it serves (`hpcserve status NAME`; `hpcserve adopt NAME` if its controller is gone)")
    ask_retire(run_dir, member)
    deadline = time.monotonic() + timeout_s
    while True:
        status = member_status(run_dir, member)
        if status in (None, MemberStatus.GONE, MemberStatus.FAILED) or time.monotonic() > deadline:
            return status
        time.sleep(poll_s)


def pending(run_dir: Path) -> list[str]:
    folder = Path(run_dir) / FOLDER
    return sorted(p.name[len(PREFIX):] for p in folder.glob(f"{PREFIX}*")) if folder.is_dir() else []


class MemberRequests:
    name = "requests"

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)

    def step(self, ctl: ControlPlane) -> None:
        for name in pending(self.run_dir):
            (self.run_dir / FOLDER / f"{PREFIX}{name}").unlink(missing_ok=True)
            member = next((m for m in ctl.members if m.name == name), None)
            if member is None or not member.status.live:
                ctl.decide("down member", f"{name}: not running, nothing to stop")
                continue
            why = "taken down (down --member)"
            if member.status is MemberStatus.SERVING and member.backends:
                ctl.decide("down member", f"{name}: drained, its streams continued elsewhere, then stopped")
                ctl.drain_all([(url, why) for url in member.backends])
            else:
                ctl.decide("down member", f"{name} ({member.status}): stopped")
                member.retired = True
                ctl.stop_member(member, why)

    def forget(self, url: str) -> None:
        pass
