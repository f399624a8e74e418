"""What a deployment keeps in a node's /tmp, and how it is closed to others and removed.

Each node's Ray runs in TEMP_ROOT/HOSTNAME (/tmp/hps-UID-RANDOM/HOST: short, since Unix socket paths are
limited to 107 bytes, and on the node's own disk). Everything else the deployment would put in /tmp goes
inside it too: `ray start` and every process under it (Ray's workers, the EngineHost actors, vLLM and its
engine core) get TMPDIR=TEMP_ROOT/HOSTNAME/tmp, so vLLM's ZMQ IPC sockets (VLLM_RPC_BASE_PATH defaults to
tempfile.gettempdir()), torch.distributed's file:// rendezvous files and any other temporary file land in
the node's private folder instead of the shared /tmp, and go with it.

Two things keep it from being enough on its own:
- Ray makes its temp folder and session folders world-writable (ray._common.utils.try_to_create_directory
  chmods each to 0777, "so others can use it"). The 0700 root above keeps others out, but no folder of ours
  should be open: the node process closes them again once Ray made them (`close_open_folders`).
- A node process killed before it cleaned up (Slurm's KillWait after a job's end, a stop that timed out,
  a killed member's job) leaves its folder behind. Every node writes where its folder is (node.json in the
  run folder), so `down` removes what is left where it can see it (`remove_run_node_folders`: local mode,
  or a /tmp the login node shares with the nodes).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

from hpcserve.core.paths import RunPaths

TMP_SUBDIR = "tmp"
TEMP_PREFIX = "hps-"  # cluster.new_temp_root: /tmp/hps-UID-RANDOM


def open_folders(root: Path) -> list[Path]:
    """Folders under root (root included) that group or others can write into; links are not followed."""
    found = []
    for folder, _dirs, _files in os.walk(root):
        try:
            if stat.S_IMODE(os.lstat(folder).st_mode) & 0o022:
                found.append(Path(folder))
        except FileNotFoundError:  # Ray removed it meanwhile
            continue
    return found


def close_open_folders(root: Path) -> list[Path]:
    """Folders under root made writable by group or others, set back to 0700 (only ours: every process
    under it runs as us). Returns those it closed."""
    closed = []
    for folder in open_folders(root):
        try:
            os.chmod(folder, 0o700)
            closed.append(folder)
        except OSError:  # gone meanwhile, or not ours: nothing to close
            pass
    return closed


def recorded_temp_dirs(run_dir: Path) -> list[Path]:
    """The node folders a run's nodes wrote into RUN_DIR/nodes/*/node.json."""
    dirs = []
    for info in sorted(Path(run_dir).glob("nodes/*/node.json")):
        try:
            temp = json.loads(info.read_text()).get("temp_dir")
        except (OSError, ValueError):
            continue
        if temp:
            dirs.append(Path(temp))
    return dirs


def ours(path: Path, uid: int) -> bool:
    """A folder of ours, no link (lstat: never followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


def named_as_ours(temp: Path, uid: int) -> bool:
    """TEMP_ROOT/HOSTNAME with TEMP_ROOT named as hpcserve names them for this user (hps-UID-...). Pure.
    A node.json is ours (0600 in a 0700 run folder), yet what it names is removed only when it is what
    hpcserve makes."""
    return temp.parent.name.startswith(f"{TEMP_PREFIX}{uid}-") and temp.name not in ("", ".", "..")


def remove_run_node_folders(run_dir: str | Path) -> list[Path]:
    """remove_node_folders for a run folder and its members' (an endpoint's, killed members included)."""
    return [p for d in [Path(run_dir), *RunPaths(Path(run_dir)).member_run_dirs()] for p in remove_node_folders(d)]


def remove_node_folders(run_dir: Path) -> list[Path]:
    """Remove what is left of a stopped run's node folders (and their roots, once empty). Returns the
    folders removed. Best effort: a folder on another node's own /tmp is not visible here."""
    uid, removed = os.geteuid(), []
    for temp in recorded_temp_dirs(run_dir):
        if not named_as_ours(temp, uid) or not ours(temp.parent, uid):
            continue
        if ours(temp, uid):
            shutil.rmtree(temp, ignore_errors=True)
            removed.append(temp)
        try:
            os.rmdir(temp.parent)  # once the last node folder in it is gone
        except OSError:
            pass
    return removed
