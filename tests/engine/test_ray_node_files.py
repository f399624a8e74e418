"""Ray's files on a node, on a /tmp every user shares (issue 15): the temp folder's name is random and its
folders are 0700 and ours, a folder or link planted under its name is refused, and the logs copied back
into the run folder never follow a link."""

from __future__ import annotations

import os
import stat

import pytest

from hpcserve.raycluster.cluster import new_temp_root
from hpcserve.raycluster.node import copy_logs, private_temp_dir


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
