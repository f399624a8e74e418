"""Process and waiting helpers for tests and benchmarks: processes started in their own session and
stopped by the PID recorded at start (never by name), and polls with a deadline instead of sleeps."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

T = TypeVar("T")


def spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Started in a session of its own (its process group is stopped with it), output to `log`."""
    with open(log, "ab") as handle:
        return subprocess.Popen(argv, stdout=handle, stderr=handle, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM to its process group, SIGKILL after timeout_s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_until(check: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.2) -> T:
    """check()'s first truthy value; an HTTP error or RuntimeError counts as "not yet". AssertionError
    naming `what` when the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
            if value:
                return value
        except (httpx.HTTPError, RuntimeError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(poll_s)
