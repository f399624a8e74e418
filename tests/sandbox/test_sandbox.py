"""The sandbox is a real Slurm cluster: jobs span nodes, GPUs are scheduled, failures are detected.

Runs against the session's sandbox (tests/sandbox/conftest.py); the tests run in file order and the
last one tears the cluster down and checks nothing is left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from hpcserve.cli.sandbox import app
from hpcserve.sandbox.cluster import Sandbox, pid_alive, pid_namespace_members, wait_for

pytestmark = pytest.mark.sandbox


def slurm(sandbox: Sandbox, *argv: str, timeout: float = 30) -> str:
    """Run a Slurm client on the login node against the sandbox; return its stdout."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **sandbox.env()})
    assert done.returncode == 0, f"{argv} failed: {done.stdout}{done.stderr}"
    return done.stdout


def wait_for_job_end(sandbox: Sandbox, job_id: str, timeout_s: float = 30) -> str:
    """Wait until the job has left the queue; return its final JobState."""
    gone = wait_for(lambda: not slurm(sandbox, "squeue", "-h", "-j", job_id).strip(), timeout_s)
    assert gone, f"job {job_id} still queued after {timeout_s} s"
    info = slurm(sandbox, "scontrol", "show", "job", job_id)
    return info.split("JobState=", 1)[1].split()[0]


def started_by_sandbox(sandbox: Sandbox, cmdline: list[str] | None) -> bool:
    """munged, a host launcher, node_init or a Slurm daemon of this sandbox. Not any process that
    mentions the sandbox's directory: on a shared machine that can be someone's shell or a command
    waiting for the test lock with SLURM_CONF=/tmp/hpcserve-sandbox/... in it."""
    if not cmdline or str(sandbox.root) not in " ".join(cmdline):
        return False
    program = Path(cmdline[0]).name
    return program in {"munged", "nsenter", "unshare", "slurmctld", "slurmd"} or \
        "hpcserve.sandbox.node_init" in cmdline


def test_up_gives_idle_nodes(sandbox: Sandbox):
    assert sandbox.node_names() == ["hsn1", "hsn2", "hsn3"]
    status = sandbox.status()
    assert status.healthy
    assert [(n.name, n.address, n.state) for n in status.nodes] == [
        ("hsn1", "198.18.0.11", "idle"), ("hsn2", "198.18.0.12", "idle"),
        ("hsn3", "198.18.0.13", "idle")]
    assert all(pid_alive(n.daemon_pid) for n in [status.controller, *status.nodes])


def test_node_has_own_hostname_names_and_no_way_out(sandbox: Sandbox):
    inside = sandbox.node_exec_argv("hsn2")
    run = lambda *cmd: subprocess.run([*inside, *cmd], capture_output=True, text=True, timeout=10)
    assert run("hostname").stdout.strip() == "hsn2"
    assert run("getent", "hosts", "hsn3").stdout.split()[0] == "198.18.0.13"
    # Own-address detection works, but the route to the outside ends inside the node.
    route = run("ip", "route", "get", "8.8.8.8").stdout
    assert "dev nullrt" in route and "src 198.18.0.12" in route
    # Own PID namespace: the node sees only its init, its slurmd and this command.
    assert run("cat", "/proc/1/comm").stdout.strip().startswith("python")
    assert set(sandbox.node_pids("hsn2")) >= {sandbox.init_pid("hsn2")}


def test_two_node_batch_job_runs_on_two_hosts(sandbox: Sandbox, tmp_path: Path):
    script = tmp_path / "job.sh"
    script.write_text('#!/bin/bash\nsrun bash -c \'echo "$(hostname) $(hostname -I)"\'\n')
    out = tmp_path / "job.out"
    job_id = slurm(sandbox, "sbatch", "--parsable", "-N2", "--ntasks-per-node=1",
                   f"--output={out}", str(script)).strip()
    assert wait_for_job_end(sandbox, job_id) == "COMPLETED", out.read_text()
    lines = [line.split() for line in out.read_text().splitlines() if line.strip()]
    hosts = {line[0] for line in lines}
    addresses = {line[1] for line in lines}
    assert len(lines) == 2 and len(hosts) == 2 and len(addresses) == 2, lines
    assert all(sandbox.node_address(host) == address for host, address, *_ in lines)


def test_gpus_per_node_sets_cuda_visible_devices(sandbox: Sandbox):
    out = slurm(sandbox, "srun", "-N2", "--gpus-per-node=2", "bash", "-c",
                'echo "$(hostname)=$CUDA_VISIBLE_DEVICES"')
    assert sorted(out.split()) == ["hsn1=0,1", "hsn2=0,1"]


def test_up_again_is_a_no_op(sandbox: Sandbox):
    def processes() -> dict:
        status = sandbox.status()
        hosts = [status.controller, *status.nodes]
        return {h.name: (sandbox.init_pid(h.name), h.daemon_pid) for h in hosts} | {
            "munged": status.munged_pid}

    before = processes()
    started = time.monotonic()
    sandbox.up()
    assert time.monotonic() - started < 5
    assert processes() == before


def test_cli_reports_status_and_one_line_errors(sandbox: Sandbox):
    runner = CliRunner()
    status = runner.invoke(app, ["status", "--json"])
    assert status.exit_code == 0, status.output
    assert [n["state"] for n in json.loads(status.output)["nodes"]] == ["idle"] * 3
    assert runner.invoke(app, ["env"]).output.strip() == f"export SLURM_CONF={sandbox.slurm_conf}"
    unknown = runner.invoke(app, ["kill-node", "hsn9"])
    assert unknown.exit_code == 2
    assert "unknown node 'hsn9'" in unknown.output and "Traceback" not in unknown.output


def test_killed_slurmd_is_noticed_and_start_node_brings_it_back(sandbox: Sandbox):
    slurmd = sandbox.status().nodes[2].daemon_pid
    assert slurmd
    sandbox.kill_slurmd("hsn3")
    assert not pid_alive(slurmd)  # kill_slurmd returns once it is dead
    # SlurmdTimeout=10: slurmctld marks the node not responding ("idle*") after ~12 s.
    assert wait_for(lambda: sandbox.node_state("hsn3").endswith("*"), 40, poll_s=0.5), \
        sandbox.node_state("hsn3")
    sandbox.start_node("hsn3")
    assert sandbox.node_state("hsn3") == "idle"


def test_kill_node_kills_everything_on_it(sandbox: Sandbox):
    victims = sandbox.node_pids("hsn1")
    assert len(victims) >= 2  # node_init and slurmd at least
    sandbox.kill_node("hsn1")
    assert not sandbox.node_pids("hsn1")  # kill_node returns once the node is gone...
    sandbox.start_node("hsn1")  # ...so booting it again right away works
    assert sandbox.node_state("hsn1") == "idle"


def test_down_leaves_nothing_behind(sandbox: Sandbox):
    namespaces = {h: (sandbox.root / "run" / f"{h}.pidns").read_text().strip()
                  for h in sandbox.host_names()}
    pids = [p for h in sandbox.host_names() for p in sandbox.node_pids(h)]
    munged = sandbox.status().munged_pid
    assert pids and munged

    started = time.monotonic()
    sandbox.down()
    took = time.monotonic() - started
    sandbox.down()  # idempotent

    assert not [p for p in [*pids, munged] if pid_alive(p)]
    assert not [ns for ns in namespaces.values() if pid_namespace_members(ns)]
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    ours = set(sandbox.host_names())  # by name: another sandbox (a second test worker's) may be running
    assert not [line for line in netns.splitlines() if line.split()[0] in ours]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()]
    assert not [n for n in names if n in {f"v{h}" for h in ours} | {sandbox.bridge}]
    left = [p.info for p in psutil.process_iter(["pid", "cmdline", "status"])
            if p.info["status"] != psutil.STATUS_ZOMBIE and started_by_sandbox(sandbox, p.info["cmdline"])]
    assert not left
    assert took < 10
