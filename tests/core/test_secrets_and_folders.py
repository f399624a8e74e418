"""Secrets and folders on a filesystem other users share: secret files are created fresh, never
through a link, read back only when ours alone; folders others can write into are refused; hpcserve's
own folders are 0700 and never taken over from someone else. Pure checks on fake stats, the rest on
tmp_path."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hpcserve.core.errors import UnsafePathError
from hpcserve.core.files import create_secret, read_secret, secret_file_problem, write_secret
from hpcserve.core.folders import (
    check_not_shared,
    link_problem,
    others_can_write,
    private_dir,
    private_dir_problem,
    shared_write_problem,
)

ME = os.geteuid()
OTHER = ME + 4242


def fake_stat(mode: int, uid: int = ME, gid: int = 0) -> os.stat_result:
    return os.stat_result((mode, 1, 1, 1, uid, gid, 0, 0, 0, 0))


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ---------------------------------------------------------------- secret files

def test_a_secret_is_a_new_file_for_its_owner_alone(tmp_path):
    path = create_secret(tmp_path / "key", "s3cret")
    assert path.read_text() == "s3cret" and mode_of(path) == 0o600
    with pytest.raises(UnsafePathError, match="exists already"):
        create_secret(path, "other")  # never reused: a file already there was not made by this run
    assert path.read_text() == "s3cret"


def test_a_planted_link_is_never_written_through(tmp_path):
    target = tmp_path / "theirs"
    target.write_text("untouched")
    link = tmp_path / "ray_auth_token"
    link.symlink_to(target)
    with pytest.raises(UnsafePathError):
        create_secret(link, "token")
    write_secret(link, "token")  # replacing renames a new file over the link itself
    assert target.read_text() == "untouched"
    assert not link.is_symlink() and link.read_text() == "token" and mode_of(link) == 0o600


def test_a_secret_is_read_only_when_ours_alone(tmp_path):
    good = create_secret(tmp_path / "good", "k\n")
    assert read_secret(good) == "k"
    loose = tmp_path / "loose"
    loose.write_text("k")
    loose.chmod(0o644)
    with pytest.raises(UnsafePathError, match="mode 0o644"):
        read_secret(loose)
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        read_secret(link)


def test_secret_file_problems_are_pure():
    assert secret_file_problem(fake_stat(stat.S_IFREG | 0o600), ME) is None
    assert secret_file_problem(fake_stat(stat.S_IFREG | 0o400), ME) is None
    assert "planted" in secret_file_problem(fake_stat(stat.S_IFREG | 0o600, uid=OTHER), ME)
    assert "chmod 600" in secret_file_problem(fake_stat(stat.S_IFREG | 0o640), ME)
    assert "regular file" in secret_file_problem(fake_stat(stat.S_IFDIR | 0o700), ME)


# ---------------------------------------------------------------- folders others can write into

@pytest.mark.parametrize("mode,private_group,expected", [
    (0o755, False, None), (0o700, False, None), (0o1777, False, None),  # /tmp: the sticky bit protects
    (0o777, False, "every user can write"), (0o757, False, "every user can write"),
    (0o775, False, "members of its group"), (0o2770, False, "members of its group"),
    (0o775, True, None),  # a user-private group: the user's alone
])
def test_shared_write_problem(mode, private_group, expected):
    problem = shared_write_problem(fake_stat(stat.S_IFDIR | mode), private_group)
    assert (problem is None) if expected is None else (expected in problem)


def test_a_link_owned_by_someone_else_decides_where_a_path_leads():
    assert link_problem(fake_stat(stat.S_IFLNK | 0o777, uid=OTHER), ME) is not None
    assert link_problem(fake_stat(stat.S_IFLNK | 0o777, uid=ME), ME) is None
    assert link_problem(fake_stat(stat.S_IFLNK | 0o777, uid=0), ME) is None  # root's links: the system's
    assert link_problem(fake_stat(stat.S_IFDIR | 0o777, uid=OTHER), ME) is None


def test_a_results_folder_others_can_write_is_refused_with_the_folder_and_the_fix(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    project.chmod(0o777)
    assert others_can_write(project / "results" / "x") == (project, others_can_write(project)[1])
    with pytest.raises(UnsafePathError) as refused:
        check_not_shared(project / "results", "results_dir", "Use another folder.")
    text = str(refused.value)
    assert str(project) in text and "every user can write" in text and "Use another folder." in text
    project.chmod(0o1777)  # sticky, like /tmp
    assert others_can_write(project / "results") is None
    project.chmod(0o755)
    assert others_can_write(project / "results") is None


# ---------------------------------------------------------------- hpcserve's own folders

def test_private_dir_is_made_0700_and_never_taken_over(tmp_path):
    run = private_dir(tmp_path / "logs" / "run-1", fresh=True)
    assert mode_of(run) == 0o700 and mode_of(tmp_path / "logs") == 0o700
    with pytest.raises(UnsafePathError, match="exists already"):
        private_dir(run, fresh=True)
    open_one = tmp_path / "old-logs"
    open_one.mkdir()
    open_one.chmod(0o755)
    private_dir(open_one)  # ours but open (an older hpcserve): closed
    assert mode_of(open_one) == 0o700
    link = tmp_path / "link"
    link.symlink_to(run)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        private_dir(link)


def test_private_dir_problems_are_pure():
    assert private_dir_problem(fake_stat(stat.S_IFDIR | 0o700), ME) is None
    assert "another user created it" in private_dir_problem(fake_stat(stat.S_IFDIR | 0o700, uid=OTHER), ME)
    assert "symbolic link" in private_dir_problem(fake_stat(stat.S_IFLNK | 0o777), ME)
    assert "not a folder" in private_dir_problem(fake_stat(stat.S_IFREG | 0o600), ME)


def test_hpcserve_home_others_can_write_is_refused(tmp_path, monkeypatch):
    from hpcserve.core.registry import list_names

    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o777)
    monkeypatch.setenv("HPCSERVE_HOME", str(home))
    with pytest.raises(UnsafePathError, match="HPCSERVE_HOME .*every user can write.*Set HPCSERVE_HOME"):
        list_names()
