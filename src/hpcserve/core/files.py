"""Files hpcserve writes: JSON written atomically (readers never see half a file, a crash leaves the old
one), and secrets written only for their owner."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Any) -> None:
    """Write-then-rename: status, `up`'s follower and a restarted controller read a whole file or the
    previous one, whatever moment the writer died at."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return default


def write_secret(path: Path, secret: str) -> Path:
    """A file only its owner can read (mode 0600). Replaces an older one of ours."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secret)
    return path


def private_dir(path: Path) -> Path:
    """A folder only its owner can enter (mode 0700): made so, or an existing one of ours tightened to it.
    Raises PermissionError with the reason when the path is a link, not a folder, or another user's (a
    folder in /tmp that someone else made first must not hold our sockets)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{path} is not a folder (a link or a file): remove it")
    if info.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {info.st_uid}, not to you: remove it or choose another folder")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path
