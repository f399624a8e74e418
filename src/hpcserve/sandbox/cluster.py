"""A real multi-node Slurm cluster on one Linux machine, for tests and demos.

Layout (names derive from `prefix`, files live under `root`, addresses in `net`.0/24):

    login node   root network namespace, bridge {prefix}br0 at .1   sbatch / srun / squeue run here
    {prefix}ctl  own net+PID+mount+UTS namespaces at .10            slurmctld
    {prefix}n1.. own net+PID+mount+UTS namespaces at .11, .12, ...  one slurmd each, hostname = NodeName

Each host is booted by `hpcserve.sandbox.node_init` (its PID 1). The file system is shared, like NFS on
a real cluster. A host's default route points into a veth whose peer stays down: "which IP am I" tricks
(UDP connect to 8.8.8.8, used by Ray and vLLM) return the node's address while no packet leaves the
machine. 198.18.0.0/15 is the RFC 2544 benchmarking range: no real host lives there.

Needs root, iproute2, util-linux and Debian's slurmctld/slurmd/slurm-client/munge (`install()`).

This module holds `Sandbox` (settings, up/down, health, failures). The work is done by procs
(commands, PIDs, waiting), network (namespaces, veths, bridge), slurmfiles (slurm.conf & co., pure),
hosts (booting a host, finding its processes), munge and packages. The names other code imports from
here (run, wait_for, pid_alive, pid_namespace_members, ...) are re-exported below.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

from hpcserve.core.errors import StageError, UsageError
from hpcserve.sandbox import hosts, munge
from hpcserve.sandbox.layout import SETTINGS_FILE, SandboxLayout
from hpcserve.sandbox.network import (
    check_subnet_free,
    disable_ipv6_on,
    netns_exists,
    network_down,
    network_up,
)
from hpcserve.sandbox.packages import PACKAGES, install_packages
from hpcserve.sandbox.procs import (
    POLL_S,
    STOP_TIMEOUT_S,
    pid_alive,
    pid_namespace_members,
    require_root,
    run,
    send_signal,
    tail,
    wait_for,
)
from hpcserve.sandbox.slurmfiles import nsswitch_files_only, slurm_conf, write_files

__all__ = [
    "HEALTHY_STATES", "PACKAGES", "POLL_S", "SETTINGS_FILE", "STOP_TIMEOUT_S", "UP_TIMEOUT_S",
    "HostStatus", "Sandbox", "SandboxStatus", "disable_ipv6_on", "ensure_sandbox",
    "nsswitch_files_only", "pid_alive", "pid_namespace_members", "require_root", "run",
    "send_signal", "tail", "wait_for",
]

UP_TIMEOUT_S = 60.0
HEALTHY_STATES = {"idle", "mixed", "allocated", "completing"}


# ------------------------------------------------------------------------------------------ status
@dataclass
class HostStatus:
    name: str
    address: str
    daemon_pid: int | None  # host PID of slurmd / slurmctld, None if not running
    state: str  # Slurm's node state as sinfo prints it ("idle", "idle*", "down*"...), "-" if unknown


@dataclass
class SandboxStatus:
    root: str
    slurm_conf: str
    healthy: bool
    munged_pid: int | None
    controller: HostStatus
    nodes: list[HostStatus] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------ sandbox
class Sandbox(SandboxLayout):
    """Settings of one sandbox cluster plus the operations on it. Cheap to create: it holds no state;
    everything is found again from files under `root` and the running processes."""

    def _client_env(self) -> dict[str, str]:
        return {**os.environ, **self.env()}

    def _check_node(self, name: str) -> None:
        if name not in self.node_names():
            raise UsageError(f"unknown node {name!r}; nodes are {', '.join(self.node_names())}")

    def _daemon_name(self, name: str) -> str:
        return "slurmctld" if name == self.controller else "slurmd"

    def _daemon_log(self, name: str) -> Path:
        return self.root / "log" / ("slurmctld.log" if name == self.controller
                                    else f"slurmd-{name}.log")

    # -------------------------------------------------------------- install
    def install(self) -> None:
        """apt-get the Slurm and munge packages unless slurmctld is already there."""
        install_packages()

    # -------------------------------------------------------------- up / down
    def up(self, timeout_s: float = UP_TIMEOUT_S) -> None:
        """Start the cluster and wait until every node is idle. A healthy sandbox is left as it is;
        anything else (half-built, other settings, a dead daemon) is torn down and built again."""
        require_root()
        self.install()
        with self._lock():
            if self.is_healthy():
                return
            self._down()
            check_subnet_free(self.net, self.bridge)
            write_files(self)
            network_up(self.bridge, f"{self.net}.1",
                       {h: self.node_address(h) for h in self.host_names()})
            munge.start_munged(self.root)
            self._boot_host(self.controller, ["slurmctld", "-D", "-f", str(self.slurm_conf)])
            for name in self.node_names():
                self._boot_node(name)
            self._wait_until_idle(self.node_names(), timeout_s)

    def down(self) -> None:
        """Stop everything the sandbox started and delete its namespaces, veths and bridge.
        Idempotent. Logs are kept under root/log."""
        require_root()
        with self._lock():
            self._down()

    def _down(self) -> None:
        present = self._hosts_present()
        munged = munge.stop_munged_begin(self.root)  # overlaps munged's ~2 s exit with the rest
        hosts.stop_hosts(self.root, present)
        munge.stop_munged_end(self.root, munged)
        network_down(self.bridge, present)
        for stale in ("state", "run"):
            shutil.rmtree(self.root / stale, ignore_errors=True)

    @contextmanager
    def _lock(self) -> Iterator[None]:
        """One up/down/start at a time per sandbox (two test runs, or a test and the CLI)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _hosts_present(self) -> list[str]:
        """Hosts to tear down: the configured ones plus any left by an `up` with more nodes."""
        return hosts.hosts_present(self.root, self.prefix, self.host_names())

    # -------------------------------------------------------------- health
    def is_healthy(self) -> bool:
        """Built with these settings, every daemon running, controller answering, all nodes up."""
        try:
            saved = json.loads((self.root / "etc" / SETTINGS_FILE).read_text())
        except (OSError, ValueError):
            return False
        if saved != self.settings() or not self._munged_pid():
            return False
        if not self._slurm_conf_current():
            return False
        if not all(self._daemon_pid(h) for h in self.host_names()):
            return False
        states = self._node_states()
        return all(states.get(n) in HEALTHY_STATES for n in self.node_names())

    def _slurm_conf_current(self) -> bool:
        """Its slurm.conf is the one this code renders: a sandbox built before a change of the
        partitions or preemption settings is rebuilt by `up`, not reused without them."""
        try:
            return self.slurm_conf.read_text() == slurm_conf(self)
        except OSError:
            return False

    def _node_states(self) -> dict[str, str]:
        """NodeName -> state as sinfo prints it ("idle", "idle*" = not responding, ...); {} if the
        controller does not answer."""
        done = run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=10,
                   env=self._client_env())
        if done.returncode != 0:
            return {}
        return dict(line.split(None, 1) for line in done.stdout.splitlines() if " " in line)

    def node_state(self, name: str) -> str:
        return self._node_states().get(name, "-")

    def _wait_until_idle(self, names: list[str], timeout_s: float) -> None:
        def all_idle() -> bool:
            self._fail_if_host_died([self.controller, *names])
            states = self._node_states()
            return all(states.get(n) == "idle" for n in names)

        if not wait_for(all_idle, timeout_s):
            states = self._node_states()
            stuck = [n for n in names if states.get(n) != "idle"]
            detail = ", ".join(f"{n}={states.get(n, 'unknown')}" for n in stuck)
            log = self.root / "log" / (f"slurmd-{stuck[0]}.log" if states else "slurmctld.log")
            raise StageError("sandbox up", f"nodes not idle after {timeout_s:.0f} s: {detail}\n"
                             f"{tail(log)}", str(log))

    def _fail_if_host_died(self, names: list[str], stage: str = "sandbox up") -> None:
        """A host whose launcher or daemon exited will not come back by waiting: report it at once.
        Both facts are exact (Popen handle / the daemon PID node_init recorded), so a host that is
        still booting never counts as dead."""
        for name in names:
            launcher = self._launcher_pid(name)
            if launcher and not hosts.daemon_exited(self.root, name):
                continue
            init_log, log = self.root / "log" / f"init-{name}.log", self._daemon_log(name)
            why = "its daemon exited" if launcher else "the host's init exited"
            raise StageError(stage, f"{self._daemon_name(name)} on {name} is not running ({why}):\n"
                             f"{tail(init_log)}\n{tail(log)}".rstrip(), str(log))

    # -------------------------------------------------------------- status
    def status(self) -> SandboxStatus:
        states = self._node_states()

        def host(name: str) -> HostStatus:
            state = "up" if name == self.controller and states else states.get(name, "-")
            return HostStatus(name, self.node_address(name), self._daemon_pid(name), state)

        return SandboxStatus(
            root=str(self.root), slurm_conf=str(self.slurm_conf), healthy=self.is_healthy(),
            munged_pid=self._munged_pid(), controller=host(self.controller),
            nodes=[host(n) for n in self.node_names()])

    # -------------------------------------------------------------- processes of a host
    def _launcher_pid(self, name: str) -> int | None:
        """Host PID of the `unshare` process that holds the host's namespaces (its parent of PID 1)."""
        return hosts.launcher_pid(self.root, name)

    def init_pid(self, name: str) -> int | None:
        """Host PID of the host's PID 1 (node_init), None if the host is not running."""
        return hosts.init_pid(self.root, name)

    def _daemon_pid(self, name: str) -> int | None:
        """Host PID of the host's slurmd / slurmctld, None if it is not running."""
        return hosts.daemon_pid(self.root, name)

    def _munged_pid(self) -> int | None:
        return munge.munged_pid(self.root)

    def node_pids(self, name: str) -> list[int]:
        """Host PIDs of every process inside the host's PID namespace (empty once it is all gone)."""
        return hosts.node_pids(self.root, name)

    def node_exec_argv(self, name: str) -> list[str]:
        """Argument-list prefix that runs a command inside a running host (its network, PID, mount
        and UTS namespaces): `subprocess.run([*sb.node_exec_argv("hsn1"), "hostname"])`."""
        init = self.init_pid(name)
        if not init:
            raise UsageError(f"{name} is not running")
        return ["nsenter", "-t", str(init), "--net", "--pid", "--mount", "--uts", "--"]

    # -------------------------------------------------------------- failures and restarts
    def kill_node(self, name: str) -> None:
        """Crash a node: SIGKILL its PID 1, so the kernel kills every process on it at once.
        Returns once they are all gone, so a `start_node` right after it sees a dead node."""
        self._check_node(name)
        init = self.init_pid(name)
        if not init:
            raise UsageError(f"{name} is not running")
        send_signal(init, signal.SIGKILL)
        wait_for(lambda: not self.node_pids(name), STOP_TIMEOUT_S)

    def kill_slurmd(self, name: str) -> None:
        """Kill only the node's slurmd (its jobs keep running); Slurm marks the node not responding
        (`idle*`) after about SlurmdTimeout and DOWN a little later. Returns once slurmd is dead."""
        self._check_node(name)
        daemon = self._daemon_pid(name)
        if not daemon:
            raise UsageError(f"slurmd of {name} is not running")
        send_signal(daemon, signal.SIGKILL)
        wait_for(lambda: not pid_alive(daemon), STOP_TIMEOUT_S)

    def start_node(self, name: str, timeout_s: float = 30.0) -> None:
        """Boot a node again and wait until it is idle. Whatever is left of it (a node whose slurmd
        died keeps its other processes) is killed first, like a power cycle. A node whose slurmd
        runs is left alone."""
        require_root()
        self._check_node(name)
        with self._lock():
            if not self._daemon_pid(name):
                if not netns_exists(name):
                    raise UsageError(f"{name} has no network namespace: run `up` first")
                hosts.stop_hosts(self.root, [name])
                self._boot_node(name)
        self._wait_until_registered(name, timeout_s)

    def _wait_until_registered(self, name: str, timeout_s: float) -> None:
        """Wait until this boot's slurmd has registered and the node takes jobs (idle, or already given
        one: a pending job starts on it the moment it registers). The state alone is not enough: right
        after a crash slurmctld still reports the node idle (it notices only after SlurmdTimeout), so
        compare the SlurmdStartTime it knows with the new slurmd's start."""
        def registered() -> bool:
            self._fail_if_host_died([self.controller, name], stage="sandbox start-node")
            daemon = self._daemon_pid(name)
            if not daemon:
                return False
            try:
                daemon_start = int(psutil.Process(daemon).create_time())
            except psutil.Error:
                return False
            info = run(["scontrol", "-o", "show", "node", name], check=False, timeout=10,
                       env=self._client_env()).stdout
            known = re.search(r"SlurmdStartTime=(\d{4}-\S+)", info)
            return known is not None and datetime.fromisoformat(known.group(1)).timestamp() >= \
                daemon_start and self.node_state(name) in HEALTHY_STATES

        if not wait_for(registered, timeout_s):
            log = self._daemon_log(name)
            raise StageError("sandbox start-node", f"{name} did not register and take jobs within "
                             f"{timeout_s:.0f} s (state {self.node_state(name)}):\n{tail(log)}",
                             str(log))

    # -------------------------------------------------------------- booting hosts
    def _boot_node(self, name: str) -> None:
        (self.root / "state" / name).mkdir(parents=True, exist_ok=True)
        self._boot_host(name, ["slurmd", "-D", "-f", str(self.slurm_conf)])

    def _boot_host(self, name: str, daemon_argv: list[str]) -> None:
        """Start `daemon_argv` as the only service of host `name`, under node_init as its PID 1."""
        hosts.boot_host(self.root, name, daemon_argv, self._daemon_log(name), self._client_env())


def ensure_sandbox(nodes: int = 3, **settings) -> Sandbox:
    """A running sandbox with these settings (reused when one is already healthy), for test fixtures:

        @pytest.fixture(scope="session")
        def sandbox():
            sb = ensure_sandbox(nodes=2)
            yield sb
            sb.down()
    """
    sandbox = Sandbox(nodes=nodes, **settings)
    sandbox.up()
    return sandbox
