"""The walltime handover's timing: the lead from measured facts, handovers one at a time,
projections while a successor waits, and the policy driven through whole job lifetimes on a simulated
endpoint (a fake ControlPlane with a clock), including the run that lost 338 requests on the sandbox."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import pytest

from hpcserve.core.config import DeploymentConfig, Layout
from hpcserve.core.runstate import Decision
from hpcserve.core.statuses import MemberRole, MemberStatus
from hpcserve.endpoint.control.decisions import (
    END_DRAIN_S,
    HANDOVER_MARGIN_S,
    HANDOVER_STARTUP_FACTOR,
    IDLE_TO_LOADED,
    Ending,
    Estimate,
    Lead,
    LoadSample,
    Startup,
    end_drain_due,
    expected_startup,
    handover_starts,
    handovers_due,
    projected_join,
    queue_estimate,
    served_during,
)
from hpcserve.endpoint.control.policies.handover import Handover
from hpcserve.endpoint.control.members import Member
from hpcserve.slurm.parse import WillRun
from hpcserve.slurm.states import JobInfo, JobState

FALLBACK = Estimate(120.0, "estimated")


# ------------------------------------------------------------------ the startup, the queue, the lead

def test_startups_under_load_count_and_idle_ones_only_until_one_is_measured():
    idle = [Startup("m0", 50.0, False), Startup("m1", 60.0, False)]
    first = expected_startup(idle, FALLBACK)
    assert first.seconds == IDLE_TO_LOADED * 60.0 and "none measured under load" in first.basis
    loaded = expected_startup([*idle, Startup("m2", 212.0, True)], FALLBACK)
    assert loaded.seconds == 212.0 and "m2 212 s" in loaded.basis and "m0" not in loaded.basis
    assert expected_startup([], FALLBACK) is FALLBACK


def test_the_longest_of_the_last_three_loaded_startups_is_planned_with():
    recent = [Startup(f"m{i}", s, True) for i, s in enumerate((400.0, 100.0, 120.0, 110.0))]
    assert expected_startup(recent, FALLBACK).seconds == 120.0  # 400 s is older than the last three


def test_queue_wait_from_slurms_expected_start():
    assert queue_estimate(1000.0 + 1800, 1000.0, "05:00:00").seconds == 1800
    assert queue_estimate(900.0, 1000.0, "05:00:00").seconds == 0  # would start at once
    assert queue_estimate(None, 1000.0, "05:00:00") == Estimate(0.0, "Slurm gave no estimate")


def test_lead_adds_queue_startup_and_margin_and_handover_s_is_a_lower_bound():
    lead = Lead(Estimate(300.0, "sbatch --test-only at 05:00:00"), Estimate(212.0, "measured under load: m2 212 s"))
    assert lead.seconds == 300 + HANDOVER_STARTUP_FACTOR * 212 + HANDOVER_MARGIN_S
    assert lead.expected_s == 512
    assert "queue 300 s (sbatch --test-only" in lead.describe() and "startup 212 s" in lead.describe()
    # The issue's run: serve.handover_s 150 was far too little for a 212 s startup; now it only raises the lead.
    assert Lead(Estimate(0, ""), Estimate(212.0, ""), configured_s=150).seconds == pytest.approx(378)
    floor = Lead(Estimate(0, ""), Estimate(50.0, ""), configured_s=600)
    assert floor.seconds == 600 and "serve.handover_s" in floor.describe()


# ------------------------------------------------------------------ one handover at a time

def test_two_jobs_ending_together_are_handed_over_one_after_the_other():
    # lead 200 s, expected 120 s from launch to serving: the first goes 120 s before the second's lead
    starts = handover_starts([Ending("a", 1000.0, 200.0, 120.0), Ending("b", 1000.0, 200.0, 120.0)])
    assert starts == {"a": 680.0, "b": 800.0}
    later = handover_starts([Ending("a", 1000.0, 200.0, 120.0), Ending("b", 1500.0, 200.0, 120.0)])
    assert later == {"a": 800.0, "b": 1300.0}  # far enough apart: each at its own lead
    three = handover_starts([Ending(m, 1000.0, 200.0, 120.0) for m in "abc"])
    assert sorted(three.values()) == [560.0, 680.0, 800.0]


def test_the_first_handover_starts_early_and_the_second_waits_for_it():
    endings = [Ending("a", 1000.0, 200.0, 120.0), Ending("b", 1000.0, 200.0, 120.0)]
    assert handovers_due(endings, [], now=679.0) == []
    first = handovers_due(endings, [], now=680.0)
    assert [c.member for c in first] == ["a"] and first[0].left_s == 320 and "one at a time" in first[0].reason
    # a's successor starts for longer than expected: b waits ...
    assert handovers_due([endings[1]], ["a"], now=799.0) == []
    # ... until its own lead has come: a late handover does not cost b its replica
    overdue = handovers_due([endings[1]], ["a"], now=800.0)
    assert [c.member for c in overdue] == ["b"] and "still in handover" in overdue[0].reason


def test_a_job_already_inside_its_lead_is_handed_over_at_once_with_its_true_time_left():
    call, = handovers_due([Ending("m1", 1029.0, 378.0, 212.0)], [], now=1000.0)
    assert call.left_s == 29 and "ends in 29 s" in call.reason


# ------------------------------------------------------------------ while a successor waits

def test_projection_from_the_expected_start_while_pending_and_from_the_start_once_running():
    assert projected_join(True, 1500.0, 100.0, now=1000.0) == 1600.0
    assert projected_join(True, 900.0, 100.0, now=1000.0) == 1100.0  # a stale estimate: not before now
    assert projected_join(True, None, 100.0, now=1000.0) is None  # no estimate from Slurm yet
    assert projected_join(False, 950.0, 100.0, now=1000.0) == 1050.0
    assert projected_join(False, 800.0, 100.0, now=1000.0) == 1000.0  # overdue: any moment now


def test_drain_in_the_last_seconds_of_a_job_and_load_during_a_startup():
    assert not end_drain_due(1000.0, 1000.0 - END_DRAIN_S - 1) and end_drain_due(1000.0, 1000.0 - END_DRAIN_S)
    history = [LoadSample(10.0, {"a": 0}, {"a": 0}), LoadSample(20.0, {"a": 2}, {"a": 1})]
    assert served_during(history, 5.0) and not served_during(history[:1], 5.0) and not served_during(history, 25.0)


# ------------------------------------------------------------------ the policy over whole job lifetimes

def slurm_time(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).isoformat(timespec="seconds")


@dataclass
class Job:
    submitted: float
    queue_s: float
    startup_s: float
    walltime_s: float

    @property
    def start(self) -> float:
        return self.submitted + self.queue_s

    @property
    def serves(self) -> float:
        return self.start + self.startup_s

    @property
    def ends(self) -> float:
        return self.start + self.walltime_s


@dataclass
class Endpoint:
    """The ControlPlane a policy sees, over simulated time: members are jobs that wait queue_s, start up
    in startup_s, and end at their limit. It counts what clients would see: seconds with no replica in
    the pool (the data plane holds requests then) and replicas whose job ended while they took requests
    (requests cut)."""

    walltime_s: float
    startup: callable  # member index -> its startup (s)
    queue: callable = lambda now: 0.0  # now -> the wait Slurm reports for a job submitted now
    now: float = 1_000_000.0
    members: list[Member] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    failed_launches: int = 0
    pool = None
    jobs: dict[str, Job] = field(default_factory=dict)
    empty_s: float = 0.0
    cut: list[str] = field(default_factory=list)
    slurm_asked: int = 0

    def start_initial(self, count: int, startup_s: float) -> None:
        for _ in range(count):
            member = self.launch(MemberRole.INITIAL, Layout())
            self.jobs[member.name] = Job(self.now, 0.0, startup_s, self.walltime_s)
        self.run_until(self.now + startup_s)
        self.empty_s = 0.0  # from the endpoint's first replica on

    def launch(self, role, layout, replaces=None, group=0, burst=False) -> Member:
        index = len(self.members)
        member = Member(f"m{index}", index, role, layout.model_dump(), {"job_id": str(100 + index), "run_dir": "/x"},
                        launched=self.now, replaces=replaces, group=group)
        self.members.append(member)
        self.jobs[member.name] = Job(self.now, self.queue(self.now), self.startup(index), self.walltime_s)
        return member

    def drain(self, url: str, why: str) -> None:
        member = next(m for m in self.members if url in m.backends)
        member.backends.remove(url)
        member.status, member.retired = MemberStatus.DRAINING, True

    def decide(self, action: str, reason: str) -> None:
        self.decisions.append(Decision(self.now, action, reason))

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def base_layout(self) -> Layout:
        return Layout()

    def serving_backends(self) -> list[str]:
        return [u for m in self.members if m.status is MemberStatus.SERVING for u in m.backends]

    def job(self, member: Member) -> JobInfo:
        job = self.jobs[member.name]
        if self.now < job.start:
            return JobInfo(member.record["job_id"], JobState.PENDING, "Resources", start_time=slurm_time(job.start))
        return JobInfo(member.record["job_id"], JobState.RUNNING, start_time=slurm_time(job.start))

    def expected_start(self, layout: Layout, group: int) -> WillRun:
        self.slurm_asked += 1
        return WillRun("1", slurm_time(self.now + self.queue(self.now)), 4, ["n1"], "debug")

    # the world moves on, one second a round as the controller's loop does
    def run_until(self, until: float, policy: Handover | None = None) -> None:
        while self.now < until:
            self.now += 1.0
            for member in self.members:
                job = self.jobs[member.name]
                if member.status is MemberStatus.LAUNCHING and self.now >= job.serves:
                    member.status, member.backends = MemberStatus.SERVING, [f"http://{member.name}"]
                    member.ready_s, member.job_started = self.now - member.launched, job.start
                    member.startup_s, member.under_load = self.now - job.start, member.role is not MemberRole.INITIAL
                    member.end_time = slurm_time(job.ends)
                elif member.status is MemberStatus.DRAINING and self.now >= job.ends - 1:
                    member.status = MemberStatus.GONE
                if member.status is MemberStatus.SERVING and self.now >= job.ends:
                    self.cut.append(member.name)
                    member.status, member.backends = MemberStatus.GONE, []
            if policy is not None:
                policy.step(self)
            if not self.serving_backends():
                self.empty_s += 1.0


def config(time: str, handover_s: float | None = None, handover: bool = True) -> DeploymentConfig:
    return DeploymentConfig(name="t", model={"path": "/m"}, cluster={"scheduler": "slurm", "time": time},
                            serve={"handover_s": handover_s, "handover": handover})


def actions(world: Endpoint) -> list[str]:
    return [d.action for d in world.decisions]


def test_the_issue_run_is_warned_about_and_never_cuts_a_request():
    """cluster.time 4, handover_s 150, first startup 50 s idle, every successor 212 s under load: the
    lead is 378 s, more than the job; successors are launched at once, the endpoint warns with the
    walltime that works, old members serve to their last seconds and nothing is cut."""
    world = Endpoint(walltime_s=240, startup=lambda i: 50.0 if i == 0 else 212.0)
    policy = Handover(config("4", handover_s=150), clock=lambda: world.now)
    world.start_initial(1, 50.0)
    world.run_until(world.now + 900, policy)
    assert world.cut == []
    warned = [d.reason for d in world.decisions if d.action == "walltime too short"]
    assert warned and "Set cluster.time to at least" in warned[-1]
    first = next(d.reason for d in world.decisions if d.action == "hand over")
    assert "launched with 189 s left" in first  # the true time left (one round after the join), not the lead
    assert "drain at job end" in actions(world) and "successor late" in actions(world)


def test_one_replica_is_handed_over_without_a_gap_when_the_startup_was_measured_under_load():
    world = Endpoint(walltime_s=1200, startup=lambda i: 100.0)
    policy = Handover(config("20"), clock=lambda: world.now)
    world.start_initial(1, 50.0)  # idle: 50 s; under load the successors need 100 s, which 2 x 50 covers
    world.run_until(world.now + 4000, policy)
    assert world.cut == [] and world.empty_s == 0
    handed = [d.reason for d in world.decisions if d.action == "handed over"]
    assert len(handed) >= 3 and all("drained" in h for h in handed)
    # from the second handover on, the lead is planned with a startup measured under load
    leads = [d.reason for d in world.decisions if d.action == "hand over"]
    assert "none measured under load" in leads[0] and "measured under load: m1 100 s" in leads[1]


def test_a_late_successor_is_bridged_and_the_old_job_is_drained_before_its_end():
    """The successor needs 400 s although 100 s were measured: the old member takes requests until
    END_DRAIN_S before its end, then the pool is empty until the successor joins (the data plane holds
    requests meanwhile); no request is cut."""
    world = Endpoint(walltime_s=1200, startup=lambda i: 400.0 if i == 1 else 100.0)
    policy = Handover(config("20"), clock=lambda: world.now)
    world.start_initial(1, 100.0)
    world.members[0].under_load = True
    world.run_until(world.now + 1500, policy)
    assert world.cut == []
    lead = HANDOVER_STARTUP_FACTOR * 100 + HANDOVER_MARGIN_S
    assert world.empty_s == pytest.approx(400 - lead + END_DRAIN_S, abs=2)
    late = next(d.reason for d in world.decisions if d.action == "successor late")
    assert "last replica: the data plane holds new requests" in late
    assert any(d.action == "drain at job end" and "does not serve yet" in d.reason for d in world.decisions)


def test_two_replicas_started_together_are_handed_over_one_at_a_time():
    world = Endpoint(walltime_s=1200, startup=lambda i: 100.0)
    policy = Handover(config("20"), clock=lambda: world.now)
    world.start_initial(2, 100.0)
    for member in world.members:
        member.under_load = True
    serving_counts, starting_counts = [], []
    for _ in range(3000):
        world.run_until(world.now + 1, policy)
        serving_counts.append(len(world.serving_backends()))
        starting_counts.append(sum(m.status is MemberStatus.LAUNCHING for m in world.members))
    assert world.cut == [] and world.empty_s == 0
    assert min(serving_counts) == 2  # never less capacity than the two replicas
    assert max(starting_counts) == 1  # never two successors starting at once
    assert len([d for d in world.decisions if d.action == "handed over"]) >= 4


def test_a_queue_that_slurm_expects_is_waited_out_while_the_old_job_serves():
    """Slurm expects a successor to wait 10 minutes: it is submitted that much earlier, and waits in the
    queue while the old job serves. Slurm is asked at most once a minute."""
    world = Endpoint(walltime_s=3600, startup=lambda i: 100.0, queue=lambda now: 600.0)
    policy = Handover(config("60"), clock=lambda: world.now)
    world.start_initial(1, 100.0)
    world.members[0].under_load = True
    world.run_until(world.now + 3600, policy)
    assert world.cut == [] and world.empty_s == 0
    handed = next(d.reason for d in world.decisions if d.action == "hand over")
    assert "queue 600 s (sbatch --test-only" in handed
    assert world.slurm_asked <= 3600 / 60 + 1


def test_a_successor_that_fails_is_launched_again_even_after_its_predecessor_stopped():
    world = Endpoint(walltime_s=1200, startup=lambda i: 400.0 if i == 1 else 100.0)
    policy = Handover(config("20"), clock=lambda: world.now)
    world.start_initial(1, 100.0)
    world.members[0].under_load = True
    end = world.jobs["m0"].ends  # the first successor fails after its predecessor was drained at its end
    world.run_until(end - 10, policy)
    assert world.members[0].status is MemberStatus.DRAINING
    successor = world.member(world.members[0].successor)
    successor.status = MemberStatus.FAILED
    world.failed_launches = 1
    world.run_until(end + 300, policy)
    assert world.cut == []
    again = [d.reason for d in world.decisions if d.action == "hand over"]
    assert len(again) == 2 and "m0" in again[1]
    assert world.members[0].successor == "m2" and world.member("m2").status is MemberStatus.SERVING


def test_no_handover_without_a_time_limit_or_outside_slurm():
    world = Endpoint(walltime_s=1e7, startup=lambda i: 100.0)
    world.start_initial(1, 100.0)
    world.members[0].end_time = "Unknown"
    Handover(config("UNLIMITED"), clock=lambda: world.now).step(world)
    local = DeploymentConfig(name="t", model={"path": "/m"})
    Handover(local, clock=lambda: world.now).step(world)
    assert world.decisions == [] and len(world.members) == 1


def test_with_handover_off_a_job_is_drained_at_its_end_and_replaced_then_without_asking_slurm():
    world = Endpoint(walltime_s=1200, startup=lambda i: 100.0)
    policy = Handover(config("20", handover=False), clock=lambda: world.now)
    world.start_initial(1, 100.0)
    end = world.jobs["m0"].ends
    world.run_until(end - 60, policy)
    assert len(world.members) == 1 and world.slurm_asked == 0  # no successor, no sbatch --test-only
    world.run_until(end + 200, policy)
    assert world.cut == []  # drained before Slurm's TERM
    assert "drain at job end" in actions(world) and "walltime too short" not in actions(world)
    assert world.members[0].successor == "m1" and world.member("m1").status is MemberStatus.SERVING
