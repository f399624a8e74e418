"""Processes of one sandbox host: boot it under node_init, find its launcher, init and daemon, stop it.

Per host NAME, files under root/run tell the processes apart:

    NAME.pid     host PID of the launcher (`nsenter` exec'ing `unshare`), written when it is started
    NAME.pidns   the host's PID namespace (/proc/PID/ns/pid), written by node_init
    NAME.daemon  the daemon's PID inside the host, written by node_init once the daemon is exec'd

Each check is exact rather than a snapshot of how a process looks: right after the start the
launcher's command line reads empty for a few milliseconds (exec in progress), and a forking slurmd
briefly leaves processes named slurmd as children of init.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import psutil

from hpcserve.sandbox.network import netns_names, netns_pids
from hpcserve.sandbox.procs import (
    STOP_TIMEOUT_S,
    launch,
    launched_here,
    namespace_pid,
    pid_alive,
    pid_namespace_members,
    read_int,
    send_signal,
    wait_for,
)

EXEC_GRACE_S = 1.0  # how long a command line may read empty before the process counts as foreign


def boot_host(root: Path, name: str, daemon_argv: list[str], daemon_log: Path,
              env: dict[str, str]) -> None:
    """Start `daemon_argv` as the only service of host `name`, under node_init as its PID 1."""
    argv = ["nsenter", f"--net=/run/netns/{name}", "--",
            "unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc", "--uts",
            "--propagation", "private", "--",
            sys.executable, "-m", "hpcserve.sandbox.node_init", name, "--root", str(root),
            "--", *daemon_argv]
    run_dir = root / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (f"{name}.pidns", f"{name}.daemon"):  # node_init writes this boot's
        (run_dir / stale).unlink(missing_ok=True)
    mark_boot(daemon_log, name)
    # A fresh init log per boot: failure messages quote it for this boot's daemon.
    launcher = launch(argv, root / "log" / f"init-{name}.log", env)
    (run_dir / f"{name}.pid").write_text(f"{launcher}\n")


def mark_boot(daemon_log: Path, name: str) -> None:
    """The daemon appends to its log across boots: a marker line keeps a failure message from
    quoting the previous boot's lines (such as `slurmd started`) as if they were this boot's."""
    daemon_log.parent.mkdir(parents=True, exist_ok=True)
    with open(daemon_log, "a") as log:
        log.write(f"[{datetime.now().isoformat(timespec='milliseconds')}] "
                  f"hpcserve sandbox: booting {name}; this boot's lines follow\n")


def launcher_pid(root: Path, name: str) -> int | None:
    """Host PID of the `unshare` process that holds the host's namespaces (its parent of PID 1)."""
    pid = read_int(root / "run" / f"{name}.pid")
    if not pid:
        return None
    if launched_here(pid):
        # Started by this process: the Popen handle is exact, and a PID we have not reaped cannot
        # be reused. (Its command line is not: see command_line.)
        return pid if pid_alive(pid) else None
    cmdline = command_line(pid)  # started by another process: guard against PID reuse
    if cmdline and "hpcserve.sandbox.node_init" in cmdline and name in cmdline and pid_alive(pid):
        return pid
    return None


def command_line(pid: int) -> list[str] | None:
    """The command line of `pid`, None when it is gone. While a process is being exec'd (nsenter
    exec'ing unshare, just after the start) it reads empty for a few ms: wait that out."""
    deadline = time.monotonic() + EXEC_GRACE_S
    while True:
        try:
            process = psutil.Process(pid)
            cmdline = process.cmdline()
            if cmdline or process.status() == psutil.STATUS_ZOMBIE:
                return cmdline
        except psutil.Error:
            return None
        if time.monotonic() >= deadline:
            return cmdline
        time.sleep(0.005)


def init_pid(root: Path, name: str) -> int | None:
    """Host PID of the host's PID 1 (node_init), None if the host is not running."""
    launcher = launcher_pid(root, name)
    if not launcher:
        return None
    try:
        children = psutil.Process(launcher).children()
    except psutil.Error:
        return None
    return children[0].pid if children and pid_alive(children[0].pid) else None


def daemon_pid(root: Path, name: str) -> int | None:
    """Host PID of the host's daemon (slurmd / slurmctld), None if it is not running (or not yet).

    Found by the PID node_init recorded, not by name: slurmd double-forks slurmstepd for each job
    step, and the grandchild is a child of init named slurmd until it execs."""
    recorded = read_int(root / "run" / f"{name}.daemon")
    init = init_pid(root, name) if recorded else None
    if not init:
        return None
    try:
        for child in psutil.Process(init).children():
            if namespace_pid(child.pid) == recorded and child.status() != psutil.STATUS_ZOMBIE:
                return child.pid
    except psutil.Error:
        pass
    return None


def daemon_exited(root: Path, name: str) -> bool:
    """node_init started this boot's daemon and it is gone (node_init stays up: see node_init)."""
    return read_int(root / "run" / f"{name}.daemon") is not None and not daemon_pid(root, name)


def node_pids(root: Path, name: str) -> list[int]:
    """Host PIDs of every process inside the host's PID namespace (empty once it is all gone)."""
    try:
        namespace = (root / "run" / f"{name}.pidns").read_text().strip()
    except OSError:
        return []
    return pid_namespace_members(namespace)


def stop_hosts(root: Path, names: list[str]) -> None:
    """SIGKILL each host's PID 1: the kernel then kills everything on it. No graceful shutdown:
    all Slurm state is thrown away anyway, and this takes 0.1 s instead of seconds per daemon."""
    launchers = {n: launcher_pid(root, n) for n in names}
    for name, launcher in launchers.items():
        init = init_pid(root, name)
        if init:
            send_signal(init, signal.SIGKILL)
        elif launcher:
            # Still booting (unshare has not forked yet): end the boot now rather than wait out
            # the timeout below. Otherwise the launcher is left alone: it exits only after its
            # init and so the whole PID namespace are gone, which is what the wait below is for.
            send_signal(launcher, signal.SIGKILL)
    alive = [p for p in launchers.values() if p]
    wait_for(lambda: not any(pid_alive(p) for p in alive), STOP_TIMEOUT_S)
    for name in names:
        # Safety net: what still runs in the host's PID or network namespace is ours.
        leftovers = set(node_pids(root, name)) | set(netns_pids(name)) | set(alive)
        for pid in leftovers:
            send_signal(pid, signal.SIGKILL)
        wait_for(lambda: not any(pid_alive(p) for p in leftovers), STOP_TIMEOUT_S)  # noqa: B023 - called here only
        (root / "run" / f"{name}.pid").unlink(missing_ok=True)


def hosts_present(root: Path, prefix: str, configured: list[str]) -> list[str]:
    """Hosts to tear down: the configured ones plus any left by an `up` with more nodes (found by
    their network namespace or launcher PID file)."""
    found = set(configured)
    host_pattern = re.compile(rf"{re.escape(prefix)}(ctl|n\d+)")
    found.update(n for n in netns_names() if host_pattern.fullmatch(n))
    run_dir = root / "run"
    if run_dir.is_dir():
        found.update(p.stem for p in run_dir.glob("*.pid") if host_pattern.fullmatch(p.stem))
    return sorted(found)
