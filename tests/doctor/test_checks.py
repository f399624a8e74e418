"""The doctor's pure checks, on output captured from Slurm 22.05 (the sandbox) and sacctmgr's format."""

from __future__ import annotations

import json

import pytest

from hpcserve.core.config import parse_config
from hpcserve.doctor.checks import (
    Captured,
    check_accounting,
    check_commands,
    check_controller,
    check_partition,
    check_submission,
    check_time,
    gpu_count,
    parse_sinfo,
    slurm_seconds,
)
from hpcserve.doctor.findings import Severity, exit_code, ok, warning
from hpcserve.doctor.probe import MARKER, check_probe, probe_argv
from hpcserve.site.profiles import profile_for

SANDBOX_SINFO = "debug*|up|infinite|3|gpu:2|4\n"
SITE_SINFO = ("gpu|up|2-00:00:00|10|gpu:a100:4(S:0-1)|64\ngpu|up|2-00:00:00|4|gpu:a100:8(S:0-1)|128\n"
              "cpu*|up|1-00:00:00|100|(null)|128\n")


def cfg(**cluster):
    site = cluster.pop("site", {})
    extra = cluster.pop("extra", {})
    return parse_config({"name": "x", "model": {"path": "org/m"},
                         "cluster": {"scheduler": "slurm", "gpus_per_node": 2, **cluster}, "site": site, **extra})


def sev(findings, check=None):
    return {f.severity for f in findings if check is None or f.check == check}


def captured(stdout="", rc=0, stderr=""):
    return Captured(("x",), rc, stdout, stderr)


@pytest.mark.parametrize("text, seconds", [("30", 1800), ("1:30", 90), ("01:00:00", 3600), ("2-00:00:00", 172800),
                                           ("1-12", 129600), ("infinite", None), ("UNLIMITED", None)])
def test_slurm_times(text, seconds):
    assert slurm_seconds(text) == seconds


def test_sinfo_lines_of_one_partition_are_merged():
    parts = parse_sinfo(SITE_SINFO)
    assert parts["gpu"].nodes == 14 and parts["gpu"].cpus == 64 and gpu_count(parts["gpu"].gres) == 8
    assert parts["cpu"].default and parts["cpu"].gres == () and parts["cpu"].time_limit_s == 86400


def test_sandbox_partition_is_fine():
    findings = check_partition(cfg(nodes=3, time="10"), captured(SANDBOX_SINFO))
    assert sev(findings) == {Severity.OK}


def test_unknown_partition_lists_the_real_ones():
    [finding] = check_partition(cfg(partition="nope"), captured(SITE_SINFO))
    assert finding.severity is Severity.BLOCKER and "cpu, gpu" in finding.what and "cluster.partition" in finding.fix


def test_gpus_on_a_partition_without_gres_suggest_site_gres_false():
    findings = check_partition(cfg(partition="cpu"), captured(SITE_SINFO))
    [gres] = [f for f in findings if f.check == "gres"]
    assert gres.severity is Severity.BLOCKER and "site.gres: false" in gres.fix


def test_no_gres_profile_on_that_partition_is_fine_and_on_a_gres_partition_warns():
    assert sev(check_partition(cfg(partition="cpu", site={"gres": False}), captured(SITE_SINFO)), "gres") == {Severity.OK}
    assert sev(check_partition(cfg(partition="gpu", site={"gres": False}), captured(SITE_SINFO)), "gres") == {Severity.WARNING}


def test_too_many_gpus_cpus_nodes_and_time_are_blockers():
    findings = check_partition(cfg(gpus_per_node=3, cpus_per_node=8, nodes=4, time="3-00:00:00"), captured(SANDBOX_SINFO))
    assert sev(findings, "gres") == {Severity.BLOCKER}
    assert len([f for f in findings if f.check == "partition" and f.severity is Severity.BLOCKER]) == 2
    findings = check_partition(cfg(partition="gpu", time="3-00:00:00"), captured(SITE_SINFO))
    assert sev(findings, "time") == {Severity.BLOCKER}


@pytest.mark.parametrize("stderr, fix_word", [
    ("sbatch: error: invalid partition specified: nope\nallocation failure: Invalid partition name specified", "sinfo"),
    ("sbatch: error: Invalid generic resource (gres) specification", "GRES"),
    ("sbatch: error: Invalid GRES specification (with and without type identification)", "--gres"),
    ("allocation failure: Requested node configuration is not available", "--gres"),
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified", "sacctmgr"),
    ("sbatch: error: Batch job submission failed: Invalid qos specification", "qos"),
])
def test_sbatch_test_only_refusals_name_the_fix(stderr, fix_word):
    [finding] = check_submission(captured(rc=1, stderr=stderr))
    assert finding.severity is Severity.BLOCKER and fix_word in finding.fix and stderr.splitlines()[-1] in finding.what


ASSOC = "proj-a||normal,high\nproj-b|gpu|normal\n"


def test_account_and_qos_against_associations():
    assert sev(check_accounting(cfg(account="proj-a", qos="high"), captured(ASSOC), "associations,limits,qos")) == {Severity.OK}
    [bad] = check_accounting(cfg(account="proj-x"), captured(ASSOC), "associations")
    assert bad.check == "account" and "proj-a, proj-b" in bad.what
    [bad] = check_accounting(cfg(account="proj-b", qos="high"), captured(ASSOC), "qos")
    assert bad.check == "qos" and "allowed: normal" in bad.what


def test_without_slurmdbd_account_and_qos_are_unchecked_warnings_only_where_enforced():
    failed = captured(rc=1, stderr="You are not running a supported accounting_storage plugin")
    assert sev(check_accounting(cfg(qos="bogus"), failed, "none")) == {Severity.INFO}
    assert sev(check_accounting(cfg(qos="bogus"), failed, "associations,limits,qos")) == {Severity.WARNING}


def test_time_shorter_than_the_load_is_a_blocker_with_a_suggested_time():
    [finding] = check_time(cfg(time="5"), 140 * 10**9)  # 140 GB at 500 MB/s (280 s) + 120 s, + 10 min of serving
    assert finding.severity is Severity.BLOCKER and "cluster.time to at least 0:17:00" in finding.fix
    assert sev(check_time(cfg(time="11"), None)) == {Severity.WARNING}
    assert sev(check_time(cfg(time="08:00:00"), 140 * 10**9)) == {Severity.OK}


def test_commands_and_controller():
    assert sev(check_commands({"sbatch": "/x"})) == {Severity.BLOCKER}
    assert sev(check_controller(Captured(("squeue",), None))) == {Severity.BLOCKER}
    assert sev(check_controller(captured(""))) == {Severity.OK}


def test_exit_code_is_2_only_with_a_blocker():
    assert exit_code([ok("a", "b"), warning("c", "d", "e")]) == 0
    assert exit_code(check_commands({})) == 2


# ---------------------------------------------------------------- the node probe

def node(host="n1", **data):
    base = {"host": host, "python": "/v/bin/python", "python_version": "3.11", "busy_ports": [], "srun": "/usr/bin/srun",
            "hpcserve": "0.1", "ray": "2.60.0", "vllm": "0.32.0", "model_error": None}
    return MARKER + json.dumps({**base, **data})


def probe(*lines, rc=0, stderr=""):
    return captured("\n".join(["noise", *lines]), rc, stderr)


def test_probe_all_fine():
    c = cfg()
    findings = check_probe(c, profile_for(c, "/r"), probe(node("n1"), node("n2")), "/m")
    assert sev(findings) == {Severity.OK}


def test_probe_names_the_node_and_the_fix():
    c = cfg(site={"runtime": "apptainer", "image": "/i.sif"})
    out = probe(node("n1", vllm=None, vllm_error="ImportError: libcudart.so.12"),
                node("n2", model_error="FileNotFoundError: [Errno 2]", busy_ports=[8000], srun=None))
    by_check = {f.check: f for f in check_probe(c, profile_for(c, "/r"), out, "/m")}
    assert "n1" in by_check["environment"].what and "libcudart" in by_check["environment"].what
    assert "site.binds" in by_check["model"].fix and "n2" in by_check["model"].what
    assert by_check["port"].severity is Severity.WARNING  # one node of two
    assert by_check["container"].severity is Severity.BLOCKER and "/usr/bin/srun" in by_check["container"].fix


def test_probe_that_could_not_start():
    c = cfg()
    [f] = check_probe(c, profile_for(c, "/r"), probe(rc=1, stderr="srun: error: Unable to allocate resources: "
                                                                 "Requested nodes are busy"), "/m")
    assert f.severity is Severity.WARNING
    [f] = check_probe(c, profile_for(c, "/r"), probe(rc=127, stderr="bash: line 3: exec: python3: not found"), "/m")
    assert f.severity is Severity.BLOCKER
    sif = cfg(site={"runtime": "apptainer", "image": "/i.sif"})
    [f] = check_probe(sif, profile_for(sif, "/r"), probe(rc=255, stderr="FATAL: container creation failed: mount "
                                                                      "/scratch: no such file or directory"), "/m")
    assert f.check == "container" and "site.binds" in f.fix


def test_results_folder_not_writable_on_a_node():
    c = cfg()
    findings = check_probe(c, profile_for(c, "/r"), probe(node("n1"), node("n2", logs_writable=False)), "/m")
    [f] = [f for f in findings if f.check == "results"]
    assert f.severity is Severity.BLOCKER and "n2" in f.what and "results_dir" in f.fix


def test_probe_argv_runs_setup_then_the_wrapped_interpreter():
    c = cfg(partition="gpu", account="a", setup=["module load x"],
            site={"runtime": "apptainer", "image": "/i.sif"})
    argv = probe_argv(c, profile_for(c, "/r"), "/login/python", "/m", [8000], "/r/logs")
    assert "--partition=gpu" in argv and "--account=a" in argv and "--immediate=60" in argv
    script = argv[argv.index("-c") + 1]
    assert script.startswith("set +eu\nmodule load x\n")
    assert argv[argv.index("hpcserve-doctor") + 1:][:5] == ["apptainer", "exec", "--nv", "--bind", "/r"]
    assert "python3" in argv and "/login/python" not in argv
    pyxis = cfg(setup=["module load x"], site={"runtime": "pyxis", "image": "/i.sqsh"})
    argv = probe_argv(pyxis, profile_for(pyxis, "/r"), "/login/python", None, [8000], "/r/logs")
    assert argv[-1] == "/r/logs" and "--container-image=/i.sqsh" in argv and "module load x" not in argv[argv.index("bash") + 2]
