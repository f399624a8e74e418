"""What a policy of the controller (self-healing, autoscale, handover) may see and do: the controller
as this Protocol, so that policies depend on an interface, not on the controller's module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from hpcserve.core.config import Layout
from hpcserve.core.runstate import Decision
from hpcserve.core.statuses import MemberRole
from hpcserve.endpoint.control.members import Member
from hpcserve.slurm.parse import WillRun
from hpcserve.slurm.states import JobInfo

if TYPE_CHECKING:  # the pool brings the prober's async HTTP stack: not for every CLI call that reads a policy
    import threading

    from hpcserve.endpoint.control.decisions import PlaneLoad
    from hpcserve.endpoint.control.plane_client import Router
    from hpcserve.endpoint.control.pool import Pool


class ControlPlane(Protocol):
    members: list[Member]
    decisions: list[Decision]
    failed_launches: int
    pool: Pool
    router: Router
    lock: threading.RLock
    stop_requested: str | None

    def launch(self, role: MemberRole, layout: Layout, replaces: str | None = None, group: int = 0,
               burst: bool = False) -> Member: ...

    def drain(self, url: str, why: str) -> None: ...

    def drain_all(self, backends: list[tuple[str, str]]) -> None: ...

    def leave(self, backends: list[tuple[str, str]]) -> None:
        """Backends out of the pool, each with its reason, in one router change (not drained)."""

    def stop_member(self, member: Member, why: str) -> None: ...

    def decide(self, action: str, reason: str) -> None: ...

    def member(self, name: str) -> Member: ...

    def base_layout(self) -> Layout: ...

    def serving_backends(self) -> list[str]: ...

    def plane_load(self) -> PlaneLoad:
        """The data plane's requests in flight and held for this model now (GET /backends)."""

    def job(self, member: Member) -> JobInfo | None:
        """Its Slurm job as Slurm reports it now (None: no job, or Slurm does not know it)."""

    def put_to_sleep(self, backend: str, why: str) -> bool:
        """The last replica of a model at zero sleeps in its allocation where its engine can (policies.sleeping);
        False: it is drained and stopped as before."""

    def queue_position(self, member: Member) -> int | None:
        """Its pending Slurm job's place among its partition's pending jobs (None: not pending, or no job)."""

    def job_now(self, member: Member) -> JobInfo | None:
        """Its Slurm job as scontrol shows it this moment (PreemptTime included); None: no job, or unknown."""

    def placed(self) -> tuple[int, int]:
        """Replicas serving or starting, not drained on purpose: (main partition, burst partition)."""

    def expected_start(self, layout: Layout, group: int) -> WillRun | None:
        """When Slurm would start a member of this shape submitted now (nothing is queued)."""


class Policy(Protocol):
    name: str

    def step(self, ctl: ControlPlane) -> None:
        """One round's decision, carried out through ctl."""

    def forget(self, url: str) -> None:
        """A backend left the pool."""
