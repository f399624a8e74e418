"""Files hpcserve writes: written atomically (readers never see half a file, a crash leaves the old one),
and secrets written only for their owner.

Atomic means write-then-rename, with the data flushed to disk before the rename: a restarted controller
adopts a running endpoint from these files after its login node rebooted, so a rename that reached the
disk before its data (possible on a crash of the machine, not only of the process) would leave an empty
state.json where the members and their jobs were."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


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


def write_json(path: Path, data: Any) -> None:
    """status, `up`'s follower and a restarted controller read a whole file or the previous one."""
    write_text(path, json.dumps(data, indent=2, default=str))


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return default


def write_secret(path: Path, secret: str) -> Path:
    """A file only its owner can read (mode 0600), created with that mode (never readable for a moment),
    written atomically. Replaces an older one of ours."""
    return write_text(path, secret, mode=0o600)


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
