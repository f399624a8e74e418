"""Liveness checks of sandbox hosts are exact: a host that is starting never looks dead.

Regression test for a CI flake: right after a launcher (`nsenter ... -- unshare ... -- node_init`) is
started, /proc/PID/cmdline reads empty for a few ms while nsenter execs unshare; a check of the
command line then called a booting node dead ("slurmd on hsn3 is not running"). Measured before the
fix: 11 of 200 first checks (5 %) saw an empty command line. Needs root (namespaces), not Slurm.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from hpcserve.sandbox import hosts
from hpcserve.sandbox.procs import launch, namespace_pid, pid_alive, wait_for

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("nsenter") and shutil.which("unshare")),
                       reason="needs root, nsenter and unshare"),
]

LAUNCHES = 100


def launcher_argv(name: str) -> list[str]:
    """The shape of a real host launcher (nsenter exec'ing unshare), with a stand-in for node_init
    whose command line names node_init and the host, as the real one does."""
    return ["nsenter", "--net=/proc/self/ns/net", "--", "unshare", "--pid", "--fork",
            "--kill-child=SIGKILL", "--", "sh", "-c", "sleep 30", "hpcserve.sandbox.node_init", name]


def start(argv: list[str], root: Path, here: bool) -> tuple[int, subprocess.Popen | None]:
    if here:
        return launch(argv, root / "log" / "init.log", dict(os.environ)), None
    # Started by "another process": no Popen handle in procs, so the command line is the guard.
    other = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    return other.pid, other


@pytest.mark.parametrize("here", [True, False], ids=["started-here", "started-elsewhere"])
def test_a_starting_host_is_never_taken_for_dead(tmp_path: Path, here: bool):
    for sub in ("run", "log"):
        (tmp_path / sub).mkdir()
    looked_dead = 0
    for _ in range(LAUNCHES):
        pid, other = start(launcher_argv("hsx1"), tmp_path, here)
        (tmp_path / "run" / "hsx1.pid").write_text(f"{pid}\n")
        looked_dead += hosts.launcher_pid(tmp_path, "hsx1") != pid  # at once, as the first poll does
        os.kill(pid, signal.SIGKILL)  # --kill-child takes the stand-in along
        if other:
            other.wait(timeout=10)
        else:
            assert wait_for(lambda: not pid_alive(pid), 10, poll_s=0.01)
    assert looked_dead == 0, f"{looked_dead} of {LAUNCHES} starting launchers looked dead"


def test_pid_file_of_another_process_or_a_dead_one_is_not_a_launcher(tmp_path: Path):
    (tmp_path / "run").mkdir()
    pid_file = tmp_path / "run" / "hsx1.pid"
    unrelated = subprocess.Popen(["sleep", "30"])
    try:
        pid_file.write_text(f"{unrelated.pid}\n")  # PID reused by something else
        assert hosts.launcher_pid(tmp_path, "hsx1") is None
    finally:
        unrelated.kill()
        unrelated.wait()
    assert hosts.launcher_pid(tmp_path, "hsx1") is None  # gone
    pid_file.write_text("")  # half-written
    assert hosts.launcher_pid(tmp_path, "hsx1") is None


def test_namespace_pid_is_the_pid_inside_the_host():
    launcher = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child=SIGKILL", "sleep", "30"])
    try:
        child = wait_for(lambda: _children(launcher.pid), 5, poll_s=0.01)
        assert child and namespace_pid(child[0]) == 1
        assert namespace_pid(launcher.pid) == launcher.pid  # same namespace as this test
    finally:
        launcher.kill()
        launcher.wait()


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
