"""Files hpcserve writes: written atomically (readers never see half a file, a crash leaves the old one),
and secrets written only for their owner.

Atomic means write-then-rename, with the data flushed to disk before the rename: a restarted controller
adopts a running endpoint from these files after its login node rebooted, so a rename that reached the
disk before its data (possible on a crash of the machine, not only of the process) would leave an empty
state.json where the members and their jobs were.

Secrets are written on a shared filesystem where other users may have prepared a trap: a symbolic link
named like our file (writing through it would put the key where they can read it, or overwrite a file
of ours), or a file of theirs that we would take for our own (a planted Ray token or API key). So a
secret is always created as a new file (O_EXCL) that is never a link (O_NOFOLLOW), and read back only
when it is ours and nobody else may read or change it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpcserve.core.errors import UnsafePathError

SECRET_MODE = 0o600
_CREATE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def write_text(path: Path, text: str, mode: int = 0o644) -> Path:
    """Write-then-rename: the file holds the old text or the new, whatever moment the writer died at.
    The temporary name is unique per process and thread (the controller writes from several threads)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json(path: Path, data: Any, indent: int | None = 2) -> None:
    """status, `up`'s follower and a restarted controller read a whole file or the previous one. indent
    None: one line, by json's C encoder (an endpoint of 256 members rewrites its state every second;
    indented, that took ~40 ms)."""
    write_text(path, json.dumps(data, indent=indent, default=str))


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return default


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the block: two `hpcserve adopt` at once
    (a crontab line and a user) must not start two controllers."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_private_text(path: Path, text: str) -> Path:
    """A new file only its owner can read or change (config.yaml: its engine.env runs on every node)."""
    path = Path(path)
    try:
        fd = os.open(path, _CREATE_NEW, SECRET_MODE)
    except FileExistsError:
        raise UnsafePathError(f"{path} exists already: hpcserve writes it fresh into a new run folder and "
                              "never takes over a file that was there before (another user may have planted "
                              "it). Remove it, or start a new run") from None
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    return path


def create_secret(path: Path, secret: str) -> Path:
    """A new secret file (mode 0600). A file or link already there is an error, never reused."""
    return write_private_text(path, secret)


def write_secret(path: Path, secret: str) -> Path:
    """Create or replace a secret file (mode 0600): a new file under a random name, renamed over the path.
    The rename replaces whatever is there (a link included) without writing through it, and readers see
    the old key or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    create_secret(tmp, secret)
    os.replace(tmp, path)
    return path


def secret_file_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a secret file with this lstat must not be trusted, or None. Pure."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != uid:
        return (f"belongs to uid {st.st_uid}, not to you (uid {uid}): another user may have planted it; "
                "remove it")
    if st.st_mode & 0o077:
        return f"has mode {oct(st.st_mode & 0o777)}: others may read or change it; chmod 600 it"
    return None


def read_secret(path: Path) -> str:
    """The secret in a file that is ours alone (no link, our uid, mode 0600 or stricter)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symbolic link, not hpcserve's secret file: remove it") from None
        raise
    with os.fdopen(fd) as handle:
        problem = secret_file_problem(os.fstat(fd), os.geteuid())
        if problem:
            raise UnsafePathError(f"{path} {problem}")
        return handle.read().strip()


def remove_files(paths: list[Path]) -> list[Path]:
    """Unlink these files (never what a link points to); returns those that were there."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(Path(path))
        except FileNotFoundError:
            pass
    return removed
