"""Folders on a filesystem other users share: where hpcserve keeps runs, the registry and Ray's files.

Every other user of a cluster can list processes, connect to any port and read world-readable files;
members of a project's group can write group-writable folders. A folder someone else can write into
lets them plant what hpcserve later runs or trusts (config.yaml with engine.env LD_PRELOAD, a Ray
token, a registry record naming PIDs that `down` kills). So:

- hpcserve's own folders (run folders, RESULTS/logs, the registry, Ray's temp folders) are mode 0700:
  made fresh where the name is new, and an existing one is used only when it is ours (no link);
- a folder the user chose (results_dir, HPCSERVE_HOME) is refused when anyone else can write into it
  or into a folder above it (without the sticky bit that protects /tmp's entries), before anything starts.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

from hpcserve.core.errors import UnsafePathError

PRIVATE_MODE = 0o700


def group_is_private(gid: int, uid: int) -> bool:
    """A user-private group (the group named like the user, with no other member): group-writable folders
    of that group are the user's alone (Debian's and Red Hat's default scheme with umask 002)."""
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(uid)
    except KeyError:
        return False
    return group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def shared_write_problem(st: os.stat_result, private_group: bool) -> str | None:
    """Why others can change what is inside a folder with this stat, or None. Pure.

    The sticky bit (/tmp, most /scratch) keeps others from renaming or removing our entries there."""
    mode = st.st_mode
    if mode & stat.S_ISVTX:
        return None
    if mode & stat.S_IWOTH:
        return f"every user can write into it (mode {oct(mode & 0o7777)})"
    if mode & stat.S_IWGRP and not private_group:
        return f"members of its group (gid {st.st_gid}) can write into it (mode {oct(mode & 0o7777)})"
    return None


def link_problem(st: os.stat_result, uid: int) -> str | None:
    """A symbolic link another user owns decides where our path leads. Pure."""
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in (uid, 0):
        return f"is a symbolic link owned by uid {st.st_uid}, who decides where it leads"
    return None


def others_can_write(path: Path) -> tuple[Path, str] | None:
    """The first folder of `path` (itself, if it exists, or one above it) that other users can write
    into or redirect, with the reason; None when only we (and root) can."""
    uid = os.geteuid()
    absolute = Path(os.path.abspath(path))
    for part in [absolute, *absolute.parents]:
        try:
            problem = link_problem(os.lstat(part), uid)
        except FileNotFoundError:
            continue
        if problem:
            return part, problem
    resolved = absolute.resolve()
    for part in [resolved, *resolved.parents]:
        try:
            st = os.stat(part)
        except FileNotFoundError:
            continue
        problem = shared_write_problem(st, group_is_private(st.st_gid, uid))
        if problem:
            return part, problem
    return None


def check_not_shared(path: Path, what: str, fix: str) -> None:
    """Refuse a folder that others can write into (or into a folder above it): UnsafePathError."""
    found = others_can_write(path)
    if found:
        folder, problem = found
        where = "" if folder == Path(os.path.abspath(path)) else f" (in {folder}, above it)"
        raise UnsafePathError(f"{what} {path}: {folder} {problem}{where}. Other users could plant or change "
                              f"the files hpcserve runs and trusts there (config, keys, Ray's token). {fix}")


def private_dir_problem(st: os.stat_result, uid: int) -> str | None:
    """Why an existing folder cannot be used as one of ours, or None. Pure."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link, not a folder"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}, not to you (uid {uid}): another user created it"
    return None


def private_dir(path: Path, fresh: bool = False) -> Path:
    """A folder only we can enter (0700). Missing: made (its missing parents too, 0700). Existing: with
    fresh, an error (a new run's folder never exists before: someone planted it); else used only when
    it is ours and no link, and closed to others if it was open."""
    path = Path(path)
    if not path.parent.exists():
        private_dir(path.parent)
    try:
        os.mkdir(path, PRIVATE_MODE)
        os.chmod(path, PRIVATE_MODE)  # the umask may have taken bits away, never added: this is for clarity
        return path
    except FileExistsError:
        if fresh:
            raise UnsafePathError(f"{path} exists already: hpcserve makes each run's folders fresh and never "
                                  "takes over one that was there before (another user may have planted it). "
                                  "Remove it, or start a new run") from None
    st = os.lstat(path)
    problem = private_dir_problem(st, os.geteuid())
    if problem:
        raise UnsafePathError(f"{path} {problem}: hpcserve will not use it. Remove it (or ask its owner to)")
    if st.st_mode & 0o077:
        os.chmod(path, PRIVATE_MODE)
    return path
