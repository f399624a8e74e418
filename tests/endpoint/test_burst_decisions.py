"""Burst replicas on a preemptible partition (autoscale.burst): where a replica goes, what a member's
signal means, and the job a burst member runs. Pure; the real preemption: tests/cluster/test_burst_preemption.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcserve.core.config import AutoscaleSpec, parse_config
from hpcserve.endpoint.control.decisions import LoadSample, decide_preemption, decide_scale, place_replica
from hpcserve.endpoint.control.members import member_config
from hpcserve.slurm.parse import parse_scontrol_jobs
from hpcserve.slurm.states import JobInfo, JobState

BURST = {"partition": "scavenger", "qos": "low", "max": 2}


def spec(**burst) -> AutoscaleSpec:
    return AutoscaleSpec(min=1, max=2, target_queue=4, scale_up_after_s=10, burst={**BURST, **burst})


def test_scale_up_fills_the_main_partition_first_then_the_burst_one():
    assert not place_replica(spec(), base=1, burst=0).burst
    placement = place_replica(spec(), base=2, burst=0)
    assert placement.burst and "main partition is at autoscale.max 2" in placement.reason
    assert place_replica(spec(), base=2, burst=1).burst
    assert place_replica(spec(), base=2, burst=2) is None


def test_burst_first_goes_to_the_burst_partition_while_it_has_room():
    placement = place_replica(spec(first=True), base=1, burst=0)
    assert placement.burst and "autoscale.burst.first" in placement.reason
    assert not place_replica(spec(first=True), base=1, burst=2).burst


def test_a_preempted_replica_is_replaced_on_the_main_partition_where_there_is_room():
    placement = place_replica(spec(first=True), base=1, burst=1, replacing_preempted=True)
    assert not placement.burst and "main partition" in placement.reason
    assert place_replica(spec(), base=2, burst=1, replacing_preempted=True).burst  # else the burst one again
    assert place_replica(spec(), base=2, burst=2, replacing_preempted=True) is None


def test_without_burst_scale_up_stays_on_the_main_partition_and_stops_at_max():
    plain = AutoscaleSpec(min=1, max=2)
    assert not place_replica(plain, base=1, burst=0).burst
    assert place_replica(plain, base=2, burst=0) is None


@pytest.mark.parametrize("replicas, action", [(2, "up"), (3, "up"), (4, "hold")])
def test_the_queue_adds_burst_replicas_up_to_max_plus_burst_max(replicas, action):
    history = [LoadSample(t, {"a": 9.0}, {"a": 1.0}) for t in range(0, 12)]
    decision = decide_scale(spec(), history, replicas, 0, {}, now=11)
    assert decision.action == action, decision.reason
    if action == "hold":
        assert "autoscale.max 2 + burst.max 2" in decision.reason


def job(preempt_time: str | None, end: str = "2026-12-06T08:08:48") -> JobInfo:
    return JobInfo("7", JobState.RUNNING, start_time="2026-12-06T08:08:40", end_time=end, time_limit="0:10:00",
                   preempt_time=preempt_time)


def test_a_signal_with_slurms_preempt_time_is_a_preemption():
    decision = decide_preemption("sb-m1", {"signal": "SIGUSR1", "time": 100.0}, job("2026-12-06T08:08:43"), now=101.0)
    assert decision.action == "preempted"
    assert "sb-m1 got SIGUSR1 1 s ago" in decision.reason and "preempted by Slurm at 2026-12-06T08:08:43" in decision.reason


def test_a_signal_ahead_of_the_time_limit_is_no_preemption():
    decision = decide_preemption("sb-m1", {"signal": "SIGUSR1", "time": 100.0}, job(None), now=100.0)
    assert decision.action == "job ending" and "no PreemptTime" in decision.reason


def test_a_moved_job_end_with_slurms_preempt_time_is_a_preemption_before_the_signal_is_seen():
    decision = decide_preemption("sb-m1", None, job("2026-12-06T08:08:43"), now=101.0)
    assert decision.action == "preempted" and "its signal not seen yet" in decision.reason


def test_a_signalled_job_slurm_no_longer_shows_counts_as_preempted():
    assert decide_preemption("sb-m1", {"signal": "SIGUSR1", "time": 1.0}, None, now=2.0).action == "preempted"


def test_scontrol_gives_the_preempt_time():
    line = ("JobId=7 JobName=x UserId=root(0) JobState=RUNNING Reason=None StartTime=2026-12-06T08:08:40 "
            "EndTime=2026-12-06T08:08:48 TimeLimit=00:10:00 PreemptEligibleTime=2026-12-06T08:08:40 "
            "PreemptTime=2026-12-06T08:08:43 SuspendTime=None NodeList=hsn1")
    assert parse_scontrol_jobs(line)[0].preempt_time == "2026-12-06T08:08:43"
    assert parse_scontrol_jobs(line.replace("PreemptTime=2026-12-06T08:08:43", "PreemptTime=None"))[0].preempt_time is None


def test_a_burst_member_runs_on_the_burst_partition_with_its_signal(tmp_path: Path):
    cfg = parse_config({"name": "sb", "model": {"path": "/m"}, "cluster": {"scheduler": "slurm", "partition": "debug",
                        "sbatch_extra": ["--constraint=x"]}, "autoscale": {"max": 1, "burst": {**BURST, "signal_s": 25}}})
    base = member_config(cfg, "sb-m0", 0, cfg.parallelism, tmp_path)
    burst = member_config(cfg, "sb-m1", 1, cfg.parallelism, tmp_path, burst=True)
    assert (base.cluster.partition, base.cluster.sbatch_extra) == ("debug", ["--constraint=x"])
    assert (burst.cluster.partition, burst.cluster.qos) == ("scavenger", "low")
    assert burst.cluster.sbatch_extra == ["--constraint=x", "--signal=B:USR1@25"]
