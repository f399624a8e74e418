"""Files hpcserve writes: JSON written atomically (readers never see half a file, a crash leaves the old
one), and secrets written only for their owner."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Any, indent: int | None = 2) -> None:
    """Write-then-rename: status, `up`'s follower and a restarted controller read a whole file or the
    previous one, whatever moment the writer died at. indent None: one line, by json's C encoder (an
    endpoint of 256 members rewrites its state every second; indented, that took ~40 ms)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=str))
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
