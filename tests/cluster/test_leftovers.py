"""`down` leaves nothing of a deployment outside its results folder, after faults too.

On the sandbox (its nodes share this machine's /tmp, as compute nodes share nothing but a node's own /tmp
on a real cluster: each node's leftovers are in the one /tmp here, beside the login node's): one replica in one Slurm job, its vLLM
process killed (kill -9 inside its node), the replacement member serving, then `hpcserve down`. Afterwards
no new entry is left in /tmp (Ray's temp folders, vLLM's ZMQ IPC sockets, anything else); while it served,
no folder of the deployment (its Ray temp folders, its results folder) was open to group or others for
writing.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
from helpers import run_cli, write_config
from test_adopt import decisions_since, replicas_now
from test_distributed_serving import status_of
from test_slurm_ray import squeue_empty

from hpcserve.core.net import shared_socket_folder
from hpcserve.endpoint.dataplane.server import socket_answers
from hpcserve.testing.harness import wait_until

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]
HERE = Path(__file__).parent
NAME = "sb-leftovers"


# Other programs on this machine write into /tmp meanwhile (pip, mktemp, the test runner, the tools that
# run these tests, valgrind's gdb pipes of a profiler run beside them): not the deployment's.
NOT_OURS = ("pip-", "tmp", "bash_", "pytest-of-", "vgdb-pipe-")


def tmp_entries() -> set[str]:
    """/tmp's entries, and those of the user's own folder there (/tmp/hpcserve-UID: data planes' admin
    sockets when a run folder is too deep for a socket path), which other runs may have made before."""
    own = shared_socket_folder()
    inside = {f"{own.name}/{name}" for name in os.listdir(own)} if own.is_dir() else set()
    return {name for name in os.listdir("/tmp") if not name.startswith(NOT_OURS)} | inside


def served_by_a_live_process(name: str) -> bool:
    """A Unix socket in /tmp that a live process still listens on belongs to something running now (the
    other pytest worker's engines, started beside this test), not to the deployment `down` stopped: its
    engines are gone, and a socket file they left refuses connections. Likewise the user's socket folder
    while it holds anything: a data plane started beside this test made it, and removes it as it stops."""
    path = Path("/tmp") / name
    if path == shared_socket_folder() and path.is_dir():
        return any(path.iterdir())
    return path.is_socket() and socket_answers(path)


def ray_temp_folders(member_dirs: list[Path]) -> list[Path]:
    """Every node's Ray temp folder of these members (node.json names it) and the root above it."""
    folders = []
    for member in member_dirs:
        for info in member.glob("nodes/*/node.json"):
            temp = Path(json.loads(info.read_text())["temp_dir"])
            folders += [temp.parent, temp]
    return folders


def open_folders(roots: list[Path]) -> list[str]:
    """Folders under roots that others (group or world) may write into."""
    found = []
    for root in roots:
        for folder, _dirs, _files in os.walk(root):
            mode = stat.S_IMODE(os.lstat(folder).st_mode)
            if mode & 0o022:
                found.append(f"{folder} {oct(mode)}")
    return found


def test_down_leaves_nothing_after_an_engine_was_replaced(slurm_env, tmp_path):
    before = tmp_entries()
    results = tmp_path / "results"
    config = write_config(tmp_path / "leftovers.yaml", HERE / "sandbox-hostile.yaml", name=NAME,
                          results_dir=str(results))
    up = run_cli("up", str(config), "--timeout", "900", timeout=1000)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        (victim, (_job, node, pid)), = replicas_now(NAME).items()
        crashed = time.time()
        subprocess.run([*slurm_env.node_exec_argv(node), "kill", "-9", str(pid)], check=True, timeout=10)
        wait_until(lambda: [d for d in decisions_since(NAME, crashed) if d["action"] == "join"], 420,
                   "the replacement serving")
        members = [Path(m["run_dir"]) for m in status_of(NAME)["members"]]
        assert victim not in replicas_now(NAME)
        opened = open_folders([*ray_temp_folders(members), Path(status_of(NAME)["run_dir"])])
    finally:
        down = run_cli("down", NAME)
    assert down.returncode == 0, down.stdout + down.stderr
    assert squeue_empty(os.environ)
    left = sorted(name for name in tmp_entries() - before if not served_by_a_live_process(name))
    print(f"\nFIGURES /tmp entries left after down: {len(left)}; open folders while serving: {len(opened)}")
    assert not left and not opened, (f"{len(left)} entries left in /tmp: {left[:12]}; "
                                     f"open folders while serving: {opened[:12]}")
