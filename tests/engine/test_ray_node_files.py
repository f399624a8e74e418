"""Ray's files on a node, on a /tmp every user shares: the temp folder's name is random and its
folders are 0700 and ours, a folder or link planted under its name is refused, and the logs copied back
into the run folder never follow a link. Issue 31: the folders Ray opens (0777) are closed again, and what
a node killed before its clean-up left is removed by `down`, only where hpcserve named it."""

from __future__ import annotations

import json
import os
import stat

import pytest

from hpcserve.raycluster.cluster import new_temp_root
from hpcserve.raycluster.node import copy_logs, private_temp_dir
from hpcserve.raycluster.nodefiles import (
    close_open_folders,
    named_as_ours,
    open_folders,
    recorded_temp_dirs,
    remove_node_folders,
)


def test_the_temp_root_is_unpredictable_and_short():
    first, second = new_temp_root(), new_temp_root()
    assert first != second and first.parent.as_posix() == "/tmp"
    assert first.name.startswith(f"hps-{os.getuid()}-") and len(str(first)) <= 32  # sockets: 107 bytes at most


def test_each_node_gets_a_new_0700_folder_of_its_own(tmp_path):
    root = tmp_path / "hps-0-abc"
    node = private_temp_dir(root, "hsn1")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and stat.S_IMODE(node.stat().st_mode) == 0o700
    assert private_temp_dir(root, "hsn2").parent == root  # the root may be shared by nodes of one machine
    with pytest.raises(Exception, match="exists already"):
        private_temp_dir(root, "hsn1")  # planted (or a second start): never taken over


def test_a_link_planted_as_the_temp_root_is_refused(tmp_path):
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir()
    (tmp_path / "hps-0-abc").symlink_to(elsewhere)
    with pytest.raises(Exception, match="symbolic link"):
        private_temp_dir(tmp_path / "hps-0-abc", "hsn1")
    assert not any(elsewhere.iterdir())


def test_copied_logs_keep_links_as_links(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("not for the run folder")
    logs = tmp_path / "temp" / "session_latest" / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text("ray log")
    (logs / "evil.log").symlink_to(secret)
    copy_logs(tmp_path / "temp", tmp_path / "node")
    copied = tmp_path / "node" / "ray"
    assert (copied / "raylet.out").read_text() == "ray log"
    assert (copied / "evil.log").is_symlink()  # the link itself, not the content it leads to


# ---------------------------------------------------------------- modes, and what `down` removes

def test_folders_ray_opened_are_closed_again(tmp_path):
    node = tmp_path / "hsn1"
    (node / "session_1" / "sockets").mkdir(parents=True)
    for folder in (node, node / "session_1", node / "session_1" / "sockets"):
        folder.chmod(0o777)  # what ray._common.utils.try_to_create_directory does
    assert len(close_open_folders(node)) == 3
    assert not open_folders(node)
    assert stat.S_IMODE((node / "session_1" / "sockets").stat().st_mode) == 0o700


def node_json(run_dir, node: str, temp_dir) -> None:
    (run_dir / "nodes" / node).mkdir(parents=True)
    (run_dir / "nodes" / node / "node.json").write_text(json.dumps({"temp_dir": str(temp_dir)}))


def test_down_removes_the_node_folders_a_killed_node_left(tmp_path):
    root = tmp_path / f"hps-{os.getuid()}-0123456789ab"
    left = private_temp_dir(root, "hsn1")
    (left / "tmp").mkdir()
    (left / "tmp" / "4b660680-9009-4735-b87f-8a3d3a35ffc1").touch()  # a vLLM IPC socket's name
    run_dir = tmp_path / "run"
    node_json(run_dir, "hsn1", left)
    node_json(run_dir, "hsn2", root / "hsn2")  # removed by its own node already
    assert recorded_temp_dirs(run_dir) == [left, root / "hsn2"]
    assert remove_node_folders(run_dir) == [left]
    assert not root.exists()  # the root too, once empty


def test_down_removes_only_what_hpcserve_names_as_its_own(tmp_path):
    """A node.json is ours, yet a folder not named as hpcserve names them (or another user's) stays."""
    other = tmp_path / "results" / "hsn1"
    other.mkdir(parents=True)
    run_dir = tmp_path / "run"
    node_json(run_dir, "hsn1", other)
    node_json(run_dir, "hsn2", tmp_path / f"hps-{os.getuid() + 1}-0123456789ab" / "hsn2")
    assert remove_node_folders(run_dir) == [] and other.is_dir()
    assert named_as_ours(tmp_path / f"hps-{os.getuid()}-0123456789ab" / "hsn1", os.getuid())
    assert not named_as_ours(tmp_path / f"hps-{os.getuid()}-0123456789ab" / "..", os.getuid())
