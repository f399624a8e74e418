"""A pending job's place in its partition's queue (the waking line's "position N"): parsed from squeue's
pending jobs sorted by priority, asked through the one Slurm interface, carried by the wake state."""

from __future__ import annotations

from test_client import FakeRunner, reply

from hpcserve.endpoint.control.decisions import wake_state
from hpcserve.slurm.client import SlurmClient
from hpcserve.slurm.parse import queue_position
from hpcserve.slurm.states import JobInfo, JobState

# squeue --noheader --states=PENDING --sort=-p,i --format=%i|%P: highest priority first, every partition
PENDING = """\
501|gpu
733|debug
502|gpu
812_3|gpu
77|gpu,gpu-long
900|gpu
"""


def test_the_place_counts_the_jobs_of_the_same_partition_ahead_by_priority():
    assert queue_position(PENDING, "501") == 1
    assert queue_position(PENDING, "502") == 2  # 733 waits for another partition
    assert queue_position(PENDING, "900") == 4
    assert queue_position(PENDING, "812_3") == 3  # an array task
    assert queue_position(PENDING, "733") == 1
    assert queue_position(PENDING, "77") == 1  # several partitions: those waiting for the same ones


def test_a_job_not_pending_has_no_place():
    assert queue_position(PENDING, "12") is None
    assert queue_position("", "501") is None
    assert queue_position("\n  \n", "501") is None


def test_the_client_asks_squeue_once_for_all_pending_jobs():
    argv = ["squeue", "--noheader", "--states=PENDING", "--sort=-p,i", "--format=%i|%P"]
    runner = FakeRunner((argv, reply(PENDING)))
    assert SlurmClient(runner=runner).queue_position("502") == 2
    assert [call[0] for call in runner.calls] == [argv]


def test_the_wake_state_carries_the_place_and_the_waking_line_says_it():
    pending = JobInfo("502", JobState.PENDING, reason="Priority")
    queued = wake_state(120, False, ("m3", 100.0), pending, None, 0.0, 110.0, position=2)
    assert queued.position == 2 and queued.describe(112.0) == "queued 12 s (Priority, position 2)"
    running = JobInfo("502", JobState.RUNNING)
    assert wake_state(120, False, ("m3", 100.0), running, None, 0.0, 110.0, position=2).position is None


def test_the_sleeper_asks_slurm_for_the_place_seldom():
    from types import SimpleNamespace

    from hpcserve.core.config import AutoscaleSpec
    from hpcserve.endpoint.control.policies.sleeping import POSITION_EVERY_S, Sleeper

    asked = []
    ctl = SimpleNamespace(queue_position=lambda member: asked.append(member.name) or 3)
    sleeper, member = Sleeper(AutoscaleSpec(min=0, idle_s=60)), SimpleNamespace(name="m1")
    pending = JobInfo("502", JobState.PENDING)
    assert sleeper.queue_position(ctl, member, pending, 100.0) == 3
    assert sleeper.queue_position(ctl, member, pending, 100.0 + POSITION_EVERY_S / 2) == 3
    assert asked == ["m1"]  # one squeue per POSITION_EVERY_S
    assert sleeper.queue_position(ctl, member, pending, 100.0 + POSITION_EVERY_S) == 3
    assert asked == ["m1", "m1"]
    assert sleeper.queue_position(ctl, member, JobInfo("502", JobState.RUNNING), 500.0) is None
    assert sleeper.queue_position(ctl, None, None, 500.0) is None and len(asked) == 2
