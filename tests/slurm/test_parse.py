"""Parsers on outputs saved from a real Slurm 22.05 cluster (data/captured/README.md says how)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from hpcserve.slurm.parse import (
    SlurmParseError,
    SlurmProblem,
    Submission,
    diagnose,
    expand_nodelist,
    normalise_time_limit,
    parse_hostnames,
    parse_sacct,
    parse_sbatch_parsable,
    parse_scontrol_fields,
    parse_scontrol_jobs,
    parse_squeue,
)
from hpcserve.slurm.states import JobInfo, JobState

CAPTURED = Path(__file__).parent / "data" / "captured"


@dataclass(frozen=True)
class Capture:
    stdout: str
    stderr: str
    returncode: int


def captured(name: str) -> Capture:
    read = lambda suffix: (CAPTURED / f"{name}.{suffix}").read_text()  # noqa: E731
    return Capture(read("stdout"), read("stderr"), int(read("rc")))


def only_job(text: str) -> JobInfo:
    jobs = parse_scontrol_jobs(text)
    assert len(jobs) == 1
    return jobs[0]


# ---------------------------------------------------------------- sbatch --parsable

@pytest.mark.parametrize("name, job_id", [
    ("sbatch-timeout", "1"), ("sbatch-running", "2"), ("sbatch-nodefail", "3"), ("sbatch-failed", "5"),
    ("sbatch-held", "7"), ("sbatch-dependency", "10"),
])
def test_sbatch_parsable_gives_the_job_id(name, job_id):
    assert parse_sbatch_parsable(captured(name).stdout) == Submission(job_id, None)


def test_sbatch_parsable_with_a_cluster_name():
    # Multi-cluster form; the test cluster has no slurmdbd, so this one is not captured.
    assert parse_sbatch_parsable("4242;gpu-cluster\n") == Submission("4242", "gpu-cluster")


@pytest.mark.parametrize("text", ["", "Submitted batch job 5\n", "5\n6\n", "abc", "5;", "5;a b"])
def test_sbatch_parsable_rejects_anything_else_and_quotes_it(text):
    with pytest.raises(SlurmParseError) as err:
        parse_sbatch_parsable(text)
    assert repr(text) in str(err.value)


# ---------------------------------------------------------------- squeue

def test_squeue_rows_of_a_busy_queue():
    jobs = {job.job_id: job for job in parse_squeue(captured("squeue-all").stdout)}
    assert sorted(jobs, key=int) == ["1", "2", "3", "6", "7", "8", "10"]
    assert jobs["3"].state is JobState.RUNNING
    assert jobs["3"].nodes == ["tbn2", "tbn3"] and jobs["3"].node_list_raw == "tbn[2-3]"
    assert jobs["2"].end_time is None            # "NONE": no time limit
    assert jobs["1"].time_limit == "00:01:00"    # squeue prints "1:00"
    assert jobs["6"].describe() == "PENDING (Resources)"
    assert jobs["6"].nodes == [] and jobs["6"].start_time is None
    assert all(job.source == "squeue" and job.exit_code is None for job in jobs.values())


def test_squeue_job_name_may_contain_the_delimiter():
    jobs = {job.job_id: job for job in parse_squeue(captured("squeue-all").stdout)}
    assert jobs["7"].name == "tb held|odd name"
    assert jobs["7"].reason == "JobHeldUser"


def test_squeue_reason_with_spaces_and_a_node_failure():
    jobs = {job.job_id: job for job in parse_squeue(captured("squeue-states-all-nodefail").stdout)}
    assert jobs["6"].reason == "Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority partitions"
    assert jobs["3"].state is JobState.NODE_FAIL
    assert jobs["3"].describe() == "NODE_FAIL on tbn[2-3]"
    assert jobs["9"].describe() == "FAILED (BadConstraints)"   # squeue has no exit code


@pytest.mark.parametrize("name", ["squeue-completed-job", "squeue-job-finished-default-states", "squeue-empty"])
def test_squeue_prints_nothing_for_finished_jobs_without_states_all(name):
    capture = captured(name)
    assert capture.returncode == 0 and parse_squeue(capture.stdout) == []


def test_squeue_line_with_too_few_fields_is_an_error():
    with pytest.raises(SlurmParseError, match="expected 8"):
        parse_squeue("123|RUNNING|None\n")


# ---------------------------------------------------------------- scontrol show job -o

@pytest.mark.parametrize("name, state, reason, exit_code, description", [
    ("scontrol-running", JobState.RUNNING, None, "0:0", "RUNNING on tbn1 since 2026-11-30T18:41:38"),
    ("scontrol-pending", JobState.PENDING, "Resources", "0:0", "PENDING (Resources)"),
    ("scontrol-held", JobState.PENDING, "JobHeldUser", "0:0", "PENDING (JobHeldUser)"),
    ("scontrol-dependency", JobState.PENDING, "Dependency", "0:0", "PENDING (Dependency)"),
    ("scontrol-completed", JobState.COMPLETED, None, "0:0", "COMPLETED, exit code 0:0"),
    ("scontrol-failed", JobState.FAILED, "NonZeroExitCode", "3:0", "FAILED, exit code 3:0"),
    ("scontrol-rejected", JobState.FAILED, "BadConstraints", "0:1", "FAILED (BadConstraints), exit code 0:1"),
    ("scontrol-cancelled", JobState.CANCELLED, "Priority", "0:0", "CANCELLED before it started"),
    ("scontrol-timeout", JobState.TIMEOUT, "TimeLimit", "0:15", "TIMEOUT after 00:01:00 time limit"),
    ("scontrol-nodefail", JobState.NODE_FAIL, "NodeDown", "0:0", "NODE_FAIL on tbn[2-3]"),
])
def test_scontrol_job_states(name, state, reason, exit_code, description):
    job = only_job(captured(name).stdout)
    assert (job.state, job.reason, job.exit_code) == (state, reason, exit_code)
    assert job.describe() == description
    assert job.source == "scontrol"


def test_scontrol_keeps_values_with_spaces_and_equals_signs():
    fields = parse_scontrol_fields(captured("scontrol-held").stdout.strip())
    assert fields["JobName"] == "tb held|odd name"
    assert fields["TRES"] == "cpu=1,mem=4000M,node=1,billing=1"
    assert fields["AllocNode:Sid"] == "localhost:2953"
    assert fields["NodeList"] == "" and fields["Power"] == ""


def test_scontrol_reason_spaces_become_underscores():
    job = only_job(captured("scontrol-pending-nodes-down").stdout)
    assert job.reason.startswith("Nodes_required_for_job_are_DOWN,_DRAINED")


def test_scontrol_running_job_nodes_and_times():
    job = only_job(captured("scontrol-nodefail-running").stdout)
    assert job.nodes == ["tbn2", "tbn3"]
    assert job.start_time == "2026-11-30T18:41:38" and job.end_time is None   # "Unknown"
    assert job.time_limit == "UNLIMITED" and job.name == "tb-nodefail"


def test_scontrol_unknown_job_prints_nothing_on_stdout():
    capture = captured("scontrol-unknown-job")
    assert capture.returncode == 1 and parse_scontrol_jobs(capture.stdout) == []


def test_scontrol_line_without_a_job_state_is_an_error():
    with pytest.raises(SlurmParseError, match="JobState"):
        parse_scontrol_jobs("JobId=5 JobName=x\n")


# ---------------------------------------------------------------- sacct

def test_sacct_c_reads_the_job_completion_file():
    (job,) = parse_sacct(captured("sacct-c-job").stdout)
    assert (job.job_id, job.name, job.state, job.exit_code) == ("5", "tb-failed", JobState.FAILED, "3:0")
    assert job.nodes == ["tbn1"] and job.source == "sacct"


def test_sacct_c_time_limits_are_minutes_and_null_nodes_are_none():
    jobs = {job.job_id: job for job in parse_sacct(captured("sacct-c-all").stdout)}
    assert jobs["1"].time_limit == "00:01:00"          # printed as "1"
    assert jobs["11"].time_limit == "365-00:00:00"     # printed as "525600"
    assert jobs["8"].nodes == [] and jobs["8"].node_list_raw == ""   # "(null)"
    assert jobs["1"].describe() == "TIMEOUT after 00:01:00 time limit"


def test_sacct_free_text_field_in_the_middle_takes_extra_delimiters():
    fields = ("JobID", "JobName", "State", "ExitCode", "Start", "End", "Timelimit", "NodeList", "Reason")
    jobs = parse_sacct(captured("sacct-c-format").stdout, fields)
    assert [job.job_id for job in jobs] == ["9", "5", "4", "8", "3"]
    (job,) = parse_sacct("7|a|b c|CANCELLED by 0|0:0|N/A|2026-11-30T18:41:42|00:10:00|None assigned\n")
    assert (job.name, job.state, job.nodes, job.start_time) == ("a|b c", JobState.CANCELLED, [], None)


def test_sacct_leaves_out_job_steps():
    # With slurmdbd, sacct lists steps under the job (not capturable on the test cluster).
    text = ("12|serve|FAILED|1:0|2026-01-01T00:00:00|2026-01-01T00:05:00|01:00:00|hsn[1-2]\n"
            "12.batch|batch|FAILED|1:0|2026-01-01T00:00:00|2026-01-01T00:05:00||hsn1\n"
            "12.0|ray|CANCELLED|0:15|2026-01-01T00:00:01|2026-01-01T00:05:00||hsn[1-2]\n")
    (job,) = parse_sacct(text)
    assert job.describe() == "FAILED, exit code 1:0" and job.nodes == ["hsn1", "hsn2"]


# ---------------------------------------------------------------- node lists

@pytest.mark.parametrize("name, nodelist", [
    ("scontrol-hostnames-mixed", "a1,b[01-02],hsn[1-3,5]"),
    ("scontrol-hostnames-nodefail", "tbn[2-3]"),
    ("hostnames-multi", "r[1-2]n[1-2]"),
    ("hostnames-padding", "n[9-11],m[08-10]"),
])
def test_expand_nodelist_agrees_with_slurm(name, nodelist):
    slurm_says = parse_hostnames(captured(name).stdout)
    assert expand_nodelist(nodelist) == slurm_says


def test_expand_nodelist_examples():
    assert expand_nodelist("hsn[1-3,5]") == ["hsn1", "hsn2", "hsn3", "hsn5"]
    assert expand_nodelist("a1,b[01-02]") == ["a1", "b01", "b02"]
    assert expand_nodelist("gpu-node7") == ["gpu-node7"]
    assert expand_nodelist("") == [] and expand_nodelist("(null)") == []


@pytest.mark.parametrize("text", ["a[1-", "a]1", "a[3-1]", "a[x]", "a[[1]]", "a[1-2"])
def test_expand_nodelist_rejects_malformed_lists(text):
    with pytest.raises(SlurmParseError):
        expand_nodelist(text)


def test_hostnames_invalid_list_is_an_error_although_slurm_exits_0():
    capture = captured("hostnames-invalid")
    assert capture.returncode == 0
    with pytest.raises(SlurmParseError, match="Invalid hostlist: x"):
        parse_hostnames(capture.stdout, capture.stderr)
    assert parse_hostnames(captured("hostnames-empty").stdout) == []


# ---------------------------------------------------------------- error texts

@pytest.mark.parametrize("name, problem", [
    ("sbatch-too-many-gpus", SlurmProblem.NODE_CONFIGURATION),
    ("sbatch-bad-partition", SlurmProblem.INVALID_PARTITION),
    ("sbatch-bad-time", SlurmProblem.INVALID_TIME),
    ("sbatch-missing-file", SlurmProblem.SCRIPT_UNREADABLE),
    ("squeue-unknown-job", SlurmProblem.INVALID_JOB_ID),
    ("scontrol-unknown-job", SlurmProblem.INVALID_JOB_ID),
    ("scancel-unknown-v", SlurmProblem.INVALID_JOB_ID),
    ("scancel-bad-id", SlurmProblem.INVALID_JOB_ID),
    ("scancel-signal-full", SlurmProblem.INVALID_JOB_ID),
    ("sacct-disabled", SlurmProblem.ACCOUNTING_DISABLED),
    ("squeue-controller-down", SlurmProblem.AUTHENTICATION),
    ("sbatch-controller-down", SlurmProblem.AUTHENTICATION),
    ("squeue-controller-unreachable", SlurmProblem.CONTROLLER_UNREACHABLE),
    ("sbatch-controller-unreachable", SlurmProblem.CONTROLLER_UNREACHABLE),
    ("squeue-no-config", SlurmProblem.NO_CONFIGURATION),
    ("squeue-no-config-source", SlurmProblem.NO_CONFIGURATION),
    ("hostnames-invalid", SlurmProblem.INVALID_HOSTLIST),
])
def test_diagnose_saved_error_outputs(name, problem):
    capture = captured(name)
    output = capture.stderr + capture.stdout
    diagnosis = diagnose(output)
    assert diagnosis.problem is problem
    assert diagnosis.line in output.splitlines() and diagnosis.hint


def test_diagnose_unknown_text():
    diagnosis = diagnose("sbatch: error: something new\n")
    assert diagnosis.problem is SlurmProblem.UNKNOWN and diagnosis.hint == ""


def test_the_silent_scancel_of_an_unknown_job():
    # Slurm 22.05: `scancel 99999` prints nothing and exits 0; only -v shows the error.
    capture = captured("scancel-unknown")
    assert (capture.returncode, capture.stdout, capture.stderr) == (0, "", "")


# ---------------------------------------------------------------- states and durations

@pytest.mark.parametrize("text, state", [
    ("RUNNING", JobState.RUNNING), ("CANCELLED by 1000", JobState.CANCELLED), ("CANCELLED+", JobState.CANCELLED),
    ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY), ("REQUEUE_HOLD", JobState.REQUEUED), ("STOPPED", JobState.SUSPENDED),
    ("SOMETHING_NEW", JobState.UNKNOWN), ("", JobState.UNKNOWN),
])
def test_job_state_parse(text, state):
    assert JobState.parse(text) is state


def test_finished_and_active_do_not_overlap():
    for state in JobState:
        assert not (state.finished and state.active), state
    assert not JobState.UNKNOWN.finished and not JobState.UNKNOWN.active
    assert JobState.COMPLETING.active and JobState.TIMEOUT.finished


@pytest.mark.parametrize("text, normal", [
    ("1:00", "00:01:00"), ("00:01:00", "00:01:00"), ("0:30", "00:00:30"), ("1:00:00", "01:00:00"),
    ("2-00:00:00", "2-00:00:00"), ("1-2", "1-02:00:00"), ("90", "01:30:00"), ("UNLIMITED", "UNLIMITED"),
    ("N/A", None), ("", None),
])
def test_normalise_time_limit(text, normal):
    assert normalise_time_limit(text) == normal


def test_describe_other_states():
    oom = JobInfo("9", JobState.OUT_OF_MEMORY, reason="OutOfMemory", exit_code="0:125", node_list_raw="hsn4")
    assert oom.describe() == "OUT_OF_MEMORY (OutOfMemory), exit code 0:125"
    assert JobInfo("9", JobState.PREEMPTED, exit_code="0:15").describe() == "PREEMPTED, exit code 0:15"
    assert JobInfo("9", JobState.CANCELLED, node_list_raw="hsn[1-2]").describe() == "CANCELLED while on hsn[1-2]"
    assert JobInfo("9", JobState.PENDING).describe() == "PENDING"
