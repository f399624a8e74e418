"""munged on the login node: the credential service every Slurm daemon and client of the sandbox uses.

munged only returns from its start once its socket listens and its PID file is written (its parent
waits on a pipe for the daemonized grandchild), so the PID file is a complete answer.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psutil

from hpcserve.core.errors import CommandError, StageError
from hpcserve.sandbox.procs import (
    STOP_TIMEOUT_S,
    pid_alive,
    read_int,
    send_signal,
    tail,
    wait_for,
)


def munged_pid(root: Path) -> int | None:
    pid = read_int(root / "munge" / "munged.pid")
    if not pid:
        return None
    try:
        return pid if psutil.Process(pid).name() == "munged" and pid_alive(pid) else None
    except psutil.Error:
        return None


def start_munged(root: Path) -> None:
    munge = root / "munge"
    munge.mkdir(parents=True, exist_ok=True)
    munge.chmod(0o711)  # munged refuses to start unless its socket directory is exactly 0711
    key = munge / "munge.key"
    if not key.exists() or key.stat().st_size == 0:
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
    # munged forks into the background: output to a file, so no pipe stays open behind it.
    log = root / "log" / "munged.out"
    with open(log, "w") as out:
        argv = ["munged", f"--socket={munge / 'munge.socket'}", f"--key-file={key}",
                f"--log-file={munge / 'munged.log'}", f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}"]
        code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out,
                              stderr=subprocess.STDOUT, timeout=30, check=False).returncode
    if code != 0:
        raise CommandError(argv, code, log.read_text() + tail(munge / "munged.log"))
    if not wait_for(lambda: munged_pid(root), 10):
        raise StageError("sandbox up", "munged did not start", str(munge / "munged.log"))


def stop_munged_begin(root: Path) -> int | None:
    """SIGTERM munged; return its PID for `stop_munged_end`. munged takes ~2 s to exit: the caller
    overlaps that with the rest of the teardown."""
    pid = munged_pid(root)
    if pid:
        send_signal(pid, signal.SIGTERM)
    return pid


def stop_munged_end(root: Path, pid: int | None) -> None:
    if pid and not wait_for(lambda: not pid_alive(pid), STOP_TIMEOUT_S):
        send_signal(pid, signal.SIGKILL)
    (root / "munge" / "munged.pid").unlink(missing_ok=True)
