"""Process and waiting helpers for tests and benchmarks: processes started in their own session and
stopped by the PID recorded at start (never by name), and polls with a deadline instead of sleeps."""

from __future__ import annotations

import itertools
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

from hpcserve.core.net import first_ephemeral_port

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


# Ports for listeners a test is about to start, between Ray's worker ports (10002-19999 by default) and the
# kernel's ephemeral range: a port the kernel handed out (bind to 0) is also where it puts the source port
# of the next outgoing connection, so another test's client took one of a 40-port farm's before the farm
# bound it, and a local deployment found the port after its router's taken.
LISTEN_FLOOR = 20000


def ports_to_listen_on(count: int, host: str = "127.0.0.1") -> list[int]:
    """count ports free now for a process about to listen on them (not necessarily consecutive)."""
    first_ephemeral = first_ephemeral_port()
    candidates = random.sample(range(LISTEN_FLOOR, first_ephemeral), min(first_ephemeral - LISTEN_FLOOR, 50 * count))
    ports = list(itertools.islice((port for port in candidates if _bindable(host, port)), count))
    if len(ports) < count:
        raise RuntimeError(f"fewer than {count} free ports below {first_ephemeral}")
    return ports


def port_block(count: int, host: str = "127.0.0.1") -> int:
    """The first of count consecutive ports free now (a deployment's router and replicas: serve.port + i)."""
    first_ephemeral = first_ephemeral_port()
    for base in random.sample(range(LISTEN_FLOOR, first_ephemeral - count), 200):
        if all(_bindable(host, port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports below {first_ephemeral}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


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
