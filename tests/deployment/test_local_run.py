"""A deployment's own process on this machine is found again by its PID and start time (LocalRun)."""

from __future__ import annotations

import socket
import subprocess
import sys

import psutil

from hpcserve.core.registry import Record
from hpcserve.core.statuses import RunKind
from hpcserve.deployment.runs import LocalRun


def run_of(pid: int, started: float) -> LocalRun:
    return LocalRun(Record(name="t", scheduler="local", run_dir="/nonexistent", kind=RunKind.ENDPOINT,
                           driver_pid=pid, driver_started=started, host=socket.gethostname()))


def test_a_live_process_stays_ours_when_the_clock_moves_its_start_and_a_reused_pid_does_not():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(process.pid).create_time()
        # The kernel's boot time is whole seconds from the wall clock: NTP moving it across a second
        # moves every process's start as an epoch by one (CI: `up` took two live controllers for exited).
        assert run_of(process.pid, started + 1.0000003).gone() is None
        assert run_of(process.pid, started - 1.0000003).gone() is None
        assert run_of(process.pid, started - 3600).gone()  # the PID now belongs to another program
    finally:
        process.kill()
        process.wait()
    assert run_of(process.pid, started).gone()
