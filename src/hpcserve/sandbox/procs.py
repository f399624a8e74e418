"""Processes for the sandbox: run a command, wait for a condition, find, test and signal PIDs.

Liveness is decided from exact facts only (a Popen handle, a PID plus its start, a namespace link),
never from what a process looks like at one instant: a process that is being exec'd shows an empty
command line for a moment, and a daemon that is forking shows two processes of the same name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil

from hpcserve.core.errors import CommandError, UsageError

T = TypeVar("T")

POLL_S = 0.2
STOP_TIMEOUT_S = 10.0  # how long a process may take to exit once signalled

# Popen handles of the host launchers started by this process, so they are reaped (no zombies in
# long-lived callers such as pytest) and their liveness is exact.
_launched: dict[int, subprocess.Popen] = {}


def run(argv: list[str], *, timeout: float = 30, check: bool = True, env: dict | None = None,
        input: str | None = None) -> subprocess.CompletedProcess:
    """Run a command (argument list, no shell); stdout and stderr together in `.stdout`.

    Raises CommandError quoting the raw output when it fails (check=True) or times out.
    """
    try:
        done = subprocess.run(argv, input=input, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, env=env, check=False,
                              stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        raise CommandError(argv, None, out or "") from None
    except FileNotFoundError:
        raise CommandError(argv, 127, f"{argv[0]}: command not found") from None
    if check and done.returncode != 0:
        raise CommandError(argv, done.returncode, done.stdout)
    return done


def launch(argv: list[str], log: Path, env: dict[str, str]) -> int:
    """Start a long-lived process in its own session, output to `log` (truncated); return its PID.
    The handle is kept, so `pid_alive` is exact for it and it is reaped when it exits."""
    with open(log, "w") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True, env=env)
    _launched[process.pid] = process
    return process.pid


def launched_here(pid: int) -> bool:
    """Whether this process started `pid` with `launch` and has not yet seen it exit."""
    return pid in _launched


def wait_for(condition: Callable[[], T], timeout_s: float, poll_s: float = POLL_S) -> T | None:
    """Poll `condition` until it returns something truthy or the deadline passes (then None)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)


def pid_alive(pid: int | None) -> bool:
    """True while `pid` runs (a zombie counts as dead)."""
    if not pid:
        return False
    if pid in _launched:
        if _launched[pid].poll() is None:
            return True
        del _launched[pid]
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def send_signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def read_int(path: Path) -> int | None:
    """The integer a PID file holds, None when it is missing or not (yet) complete."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def write_atomically(path: Path, text: str) -> None:
    """Readers see the old file or the whole new one, never a half-written one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def pid_namespace_members(namespace: str) -> list[int]:
    """Host PIDs of all processes whose PID namespace is `namespace` (as in /proc/PID/ns/pid)."""
    members = []
    for pid in psutil.pids():
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") == namespace:
                members.append(pid)
        except OSError:
            continue
    return members


def namespace_pid(pid: int) -> int | None:
    """The PID that process `pid` (a host PID) has inside its own PID namespace (NSpid's last field)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def require_root() -> None:
    if os.geteuid() != 0:
        raise UsageError("the sandbox needs root (network namespaces, mounts, slurmd); run it as root")
