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
"""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import psutil

from hpcserve.errors import CommandError, StageError, UsageError

T = TypeVar("T")

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "iproute2"]
SETTINGS_FILE = "sandbox.json"  # under root/etc: what the running sandbox was built with
POLL_S = 0.2
UP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
HEALTHY_STATES = {"idle", "mixed", "allocated", "completing"}

# Popen handles of the host launchers we started in this process, so they are reaped (no zombies in
# long-lived callers such as pytest) and their liveness is exact.
_launched: dict[int, subprocess.Popen] = {}


# ------------------------------------------------------------------------------------------ helpers
def run(argv: list[str], *, timeout: float = 30, check: bool = True, env: dict | None = None,
        input: str | None = None) -> subprocess.CompletedProcess:
    """Run a command (argument list, no shell); stdout and stderr together in `.stdout`.

    Raises CommandError quoting the raw output when it fails (check=True) or times out.
    """
    try:
        done = subprocess.run(argv, input=input, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, env=env,
                              stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        raise CommandError(argv, None, out or "") from None
    except FileNotFoundError:
        raise CommandError(argv, 127, f"{argv[0]}: command not found") from None
    if check and done.returncode != 0:
        raise CommandError(argv, done.returncode, done.stdout)
    return done


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
@dataclass
class Sandbox:
    """Settings of one sandbox cluster plus the operations on it. Cheap to create: it holds no state;
    everything is found again from files under `root` and the running processes."""

    root: Path = Path("/tmp/hpcserve-sandbox")
    nodes: int = 3
    prefix: str = "hs"
    net: str = "198.18.0"
    cpus_per_node: int = 4
    mem_mb: int = 4000
    gpus_per_node: int = 2

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if not 1 <= self.nodes <= 50:
            raise UsageError(f"nodes must be between 1 and 50, not {self.nodes}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", self.prefix):
            # interface names are at most 15 characters: "v" + prefix + "n50" must fit
            raise UsageError(f"prefix must be 1-6 lower-case letters/digits, not {self.prefix!r}")
        try:
            ipaddress.IPv4Network(f"{self.net}.0/24")
        except ValueError:
            raise UsageError(f"net must be the first three octets of an IPv4 /24, like 198.18.0, "
                             f"not {self.net!r}") from None
        if self.cpus_per_node < 1 or self.mem_mb < 100 or not 0 <= self.gpus_per_node <= 16:
            raise UsageError("need cpus_per_node >= 1, mem_mb >= 100 and 0 <= gpus_per_node <= 16")

    # -------------------------------------------------------------- names and paths
    @classmethod
    def load(cls, root: Path | str = Path("/tmp/hpcserve-sandbox")) -> Sandbox:
        """The sandbox last built under `root` (its saved settings), or the defaults if none was."""
        saved = Path(root) / "etc" / SETTINGS_FILE
        try:
            settings = json.loads(saved.read_text())
        except (OSError, ValueError):
            return cls(root=Path(root))
        settings["root"] = Path(root)
        return cls(**settings)

    @property
    def slurm_conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def controller(self) -> str:
        return f"{self.prefix}ctl"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br0"

    def node_names(self) -> list[str]:
        return [f"{self.prefix}n{i}" for i in range(1, self.nodes + 1)]

    def host_names(self) -> list[str]:
        return [self.controller, *self.node_names()]

    def node_address(self, name: str) -> str:
        """IP address of a node (or of the controller)."""
        if name == self.controller:
            return f"{self.net}.10"
        match = re.fullmatch(rf"{re.escape(self.prefix)}n(\d+)", name)
        if not match or not 1 <= int(match.group(1)) <= 50:
            raise UsageError(f"unknown sandbox host {name!r}; nodes are {', '.join(self.node_names())}")
        return f"{self.net}.{10 + int(match.group(1))}"

    def env(self) -> dict[str, str]:
        """Environment for Slurm clients (sbatch, srun, squeue, ...) on the login node."""
        return {"SLURM_CONF": str(self.slurm_conf)}

    def _settings(self) -> dict:
        settings = dataclasses.asdict(self)
        del settings["root"]
        return settings

    def _client_env(self) -> dict[str, str]:
        return {**os.environ, **self.env()}

    def _check_node(self, name: str) -> None:
        if name not in self.node_names():
            raise UsageError(f"unknown node {name!r}; nodes are {', '.join(self.node_names())}")

    # -------------------------------------------------------------- install
    def install(self) -> None:
        """apt-get the Slurm and munge packages unless slurmctld is already there.

        No systemd in containers and CI: a temporary policy-rc.d (exit 101 = "deny") keeps the
        packages' postinst from starting the system-wide services; the sandbox starts its own.
        """
        if shutil.which("slurmctld"):
            return
        require_root()
        policy = Path("/usr/sbin/policy-rc.d")
        added_policy = not policy.exists()
        if added_policy:
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
        try:
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            run(["apt-get", "update", "-qq"], timeout=300, env=env)
            run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
                timeout=900, env=env)
        finally:
            if added_policy:
                policy.unlink(missing_ok=True)

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
            self._check_subnet_free()
            self._write_files()
            self._network_up()
            self._start_munged()
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
        hosts = self._hosts_present()
        munged = self._munged_pid()
        if munged:
            send_signal(munged, signal.SIGTERM)  # munged takes ~2 s to exit: overlap with the rest
        self._stop_hosts(hosts)
        if munged and not wait_for(lambda: not pid_alive(munged), STOP_TIMEOUT_S):
            send_signal(munged, signal.SIGKILL)
        (self.root / "munge" / "munged.pid").unlink(missing_ok=True)
        self._network_down(hosts)
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
        found = set(self.host_names())
        node_pattern = re.compile(rf"{re.escape(self.prefix)}(ctl|n\d+)")
        netns_dir = Path("/run/netns")
        if netns_dir.is_dir():
            found.update(p.name for p in netns_dir.iterdir() if node_pattern.fullmatch(p.name))
        run_dir = self.root / "run"
        if run_dir.is_dir():
            found.update(p.stem for p in run_dir.glob("*.pid") if node_pattern.fullmatch(p.stem))
        return sorted(found)

    # -------------------------------------------------------------- health
    def is_healthy(self) -> bool:
        """Built with these settings, every daemon running, controller answering, all nodes up."""
        try:
            saved = json.loads((self.root / "etc" / SETTINGS_FILE).read_text())
        except (OSError, ValueError):
            return False
        if saved != self._settings() or not self._munged_pid():
            return False
        if not all(self._daemon_pid(h) for h in self.host_names()):
            return False
        states = self._node_states()
        return all(states.get(n) in HEALTHY_STATES for n in self.node_names())

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
        (node_init writes "daemon ... exited" to its log when the daemon dies.)"""
        for name in names:
            init_log = self.root / "log" / f"init-{name}.log"
            if self._launcher_pid(name) and "exited (" not in tail(init_log):
                continue
            daemon = "slurmctld" if name == self.controller else "slurmd"
            log = self.root / "log" / ("slurmctld.log" if name == self.controller
                                       else f"slurmd-{name}.log")
            raise StageError(stage, f"{daemon} on {name} is not running:\n"
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
        try:
            pid = int((self.root / "run" / f"{name}.pid").read_text())
        except (OSError, ValueError):
            return None
        try:  # guard against PID reuse: it must still be our launcher of this host
            cmdline = psutil.Process(pid).cmdline()
        except psutil.Error:
            return None
        if "hpcserve.sandbox.node_init" in cmdline and name in cmdline and pid_alive(pid):
            return pid
        return None

    def init_pid(self, name: str) -> int | None:
        """Host PID of the host's PID 1 (node_init), None if the host is not running."""
        launcher = self._launcher_pid(name)
        if not launcher:
            return None
        try:
            children = psutil.Process(launcher).children()
        except psutil.Error:
            return None
        return children[0].pid if children and pid_alive(children[0].pid) else None

    def _daemon_pid(self, name: str) -> int | None:
        """Host PID of the host's slurmd / slurmctld, None if it is not running."""
        init = self.init_pid(name)
        if not init:
            return None
        wanted = "slurmctld" if name == self.controller else "slurmd"
        try:
            for child in psutil.Process(init).children():
                if child.name() == wanted and child.status() != psutil.STATUS_ZOMBIE:
                    return child.pid
        except psutil.Error:
            pass
        return None

    def node_pids(self, name: str) -> list[int]:
        """Host PIDs of every process inside the host's PID namespace (empty once it is all gone)."""
        try:
            namespace = (self.root / "run" / f"{name}.pidns").read_text().strip()
        except OSError:
            return []
        return pid_namespace_members(namespace)

    def node_exec_argv(self, name: str) -> list[str]:
        """Argument-list prefix that runs a command inside a running host (its network, PID, mount
        and UTS namespaces): `subprocess.run([*sb.node_exec_argv("hsn1"), "hostname"])`."""
        init = self.init_pid(name)
        if not init:
            raise UsageError(f"{name} is not running")
        return ["nsenter", "-t", str(init), "--net", "--pid", "--mount", "--uts", "--"]

    # -------------------------------------------------------------- failures and restarts
    def kill_node(self, name: str) -> None:
        """Crash a node: SIGKILL its PID 1, so the kernel kills every process on it at once."""
        self._check_node(name)
        init = self.init_pid(name)
        if not init:
            raise UsageError(f"{name} is not running")
        send_signal(init, signal.SIGKILL)

    def kill_slurmd(self, name: str) -> None:
        """Kill only the node's slurmd (its jobs keep running); Slurm marks the node not responding
        (`idle*`) after about SlurmdTimeout and DOWN a little later."""
        self._check_node(name)
        daemon = self._daemon_pid(name)
        if not daemon:
            raise UsageError(f"slurmd of {name} is not running")
        send_signal(daemon, signal.SIGKILL)

    def start_node(self, name: str, timeout_s: float = 30.0) -> None:
        """Boot a node again and wait until it is idle. Whatever is left of it (a node whose slurmd
        died keeps its other processes) is killed first, like a power cycle. A node whose slurmd
        runs is left alone."""
        require_root()
        self._check_node(name)
        with self._lock():
            if not self._daemon_pid(name):
                if not Path(f"/run/netns/{name}").exists():
                    raise UsageError(f"{name} has no network namespace: run `up` first")
                self._stop_hosts([name])
                self._boot_node(name)
        self._wait_until_registered(name, timeout_s)

    def _wait_until_registered(self, name: str, timeout_s: float) -> None:
        """Wait until this boot's slurmd has registered and the node is idle. The state alone is not
        enough: right after a crash slurmctld still reports the node idle (it notices only after
        SlurmdTimeout), so compare the SlurmdStartTime it knows with the new slurmd's start."""
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
            return bool(known) and datetime.fromisoformat(known.group(1)).timestamp() >= \
                daemon_start and self.node_state(name) == "idle"

        if not wait_for(registered, timeout_s):
            log = self.root / "log" / f"slurmd-{name}.log"
            raise StageError("sandbox start-node", f"{name} did not register as idle within "
                             f"{timeout_s:.0f} s (state {self.node_state(name)}):\n{tail(log)}",
                             str(log))

    # -------------------------------------------------------------- booting and stopping hosts
    def _boot_node(self, name: str) -> None:
        (self.root / "state" / name).mkdir(parents=True, exist_ok=True)
        self._boot_host(name, ["slurmd", "-D", "-f", str(self.slurm_conf)])

    def _boot_host(self, name: str, daemon_argv: list[str]) -> None:
        """Start `daemon_argv` as the only service of host `name`, under node_init as its PID 1."""
        argv = ["nsenter", f"--net=/run/netns/{name}", "--",
                "unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc", "--uts",
                "--propagation", "private", "--",
                sys.executable, "-m", "hpcserve.sandbox.node_init", name, "--root", str(self.root),
                "--", *daemon_argv]
        (self.root / "run").mkdir(parents=True, exist_ok=True)
        (self.root / "run" / f"{name}.pidns").unlink(missing_ok=True)
        # A fresh log per boot: _fail_if_host_died reads it for this boot's daemon exit.
        with open(self.root / "log" / f"init-{name}.log", "w") as log:
            launcher = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        env=self._client_env())
        _launched[launcher.pid] = launcher
        (self.root / "run" / f"{name}.pid").write_text(f"{launcher.pid}\n")

    def _stop_hosts(self, names: list[str]) -> None:
        """SIGKILL each host's PID 1: the kernel then kills everything on it. No graceful shutdown:
        all Slurm state is thrown away anyway, and this takes 0.1 s instead of seconds per daemon."""
        launchers = [p for p in (self._launcher_pid(n) for n in names) if p]
        for name in names:
            init = self.init_pid(name)
            if init:
                send_signal(init, signal.SIGKILL)
        wait_for(lambda: not any(pid_alive(p) for p in launchers), STOP_TIMEOUT_S)
        for name in names:
            # Safety net: what still runs in the host's PID or network namespace is ours.
            leftovers = set(self.node_pids(name)) | set(self._netns_pids(name)) | set(launchers)
            for pid in leftovers:
                send_signal(pid, signal.SIGKILL)
            wait_for(lambda: not any(pid_alive(p) for p in leftovers), STOP_TIMEOUT_S)
            (self.root / "run" / f"{name}.pid").unlink(missing_ok=True)

    def _netns_pids(self, name: str) -> list[int]:
        if not Path(f"/run/netns/{name}").exists():
            return []
        done = run(["ip", "netns", "pids", name], check=False, timeout=10)
        return [int(p) for p in done.stdout.split() if p.isdigit()]

    # -------------------------------------------------------------- munge
    def _munged_pid(self) -> int | None:
        try:
            pid = int((self.root / "munge" / "munged.pid").read_text())
            return pid if psutil.Process(pid).name() == "munged" and pid_alive(pid) else None
        except (OSError, ValueError, psutil.Error):
            return None

    def _start_munged(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o711)  # munged refuses to start unless its socket directory is exactly 0711
        key = munge / "munge.key"
        if not key.exists() or key.stat().st_size == 0:
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        # munged forks into the background: output to a file, so no pipe stays open behind it.
        log = self.root / "log" / "munged.out"
        with open(log, "w") as out:
            argv = ["munged", f"--socket={munge / 'munge.socket'}", f"--key-file={key}",
                    f"--log-file={munge / 'munged.log'}", f"--pid-file={munge / 'munged.pid'}",
                    f"--seed-file={munge / 'munged.seed'}"]
            code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=30).returncode
        if code != 0:
            raise CommandError(argv, code, log.read_text() + tail(munge / "munged.log"))
        if not wait_for(self._munged_pid, 10):
            raise StageError("sandbox up", "munged did not start", str(munge / "munged.log"))

    # -------------------------------------------------------------- network
    def _check_subnet_free(self) -> None:
        """Refuse to overlap another test cluster (e.g. the reference one on the same /24)."""
        ours = ipaddress.IPv4Network(f"{self.net}.0/24")
        done = run(["ip", "-o", "-4", "addr", "show"], timeout=10)
        for line in done.stdout.splitlines():
            fields = line.split()
            iface, address = fields[1], ipaddress.IPv4Interface(fields[3])
            if iface != self.bridge and address.network.overlaps(ours):
                raise UsageError(f"{ours} is already used by interface {iface} (another test "
                                 f"cluster?); stop it or choose another net (e.g. `up --net 198.18.1`)")

    def _network_up(self) -> None:
        """Bridge on the login node, one veth per host, and the dead-end default route inside."""
        batch = [f"link add {self.bridge} type bridge",
                 f"addr replace {self.net}.1/24 dev {self.bridge}",
                 f"link set {self.bridge} up"]
        for host in self.host_names():
            batch += [f"netns add {host}",
                      f"link add v{host} type veth peer name eth0 netns {host}",
                      f"link set v{host} master {self.bridge} up"]
        run(["ip", "-batch", "-"], input="\n".join(batch) + "\n")
        for iface in [self.bridge, *(f"v{h}" for h in self.host_names())]:
            disable_ipv6_on(iface)
        for host in self.host_names():
            address = self.node_address(host)
            # The default route's veth peer stays DOWN: packets to non-test addresses are dropped
            # inside the node. (No dummy module on these kernels; a blackhole route makes UDP
            # connect() fail, which breaks Ray's and vLLM's own-address detection.)
            inside = [f"addr add {address}/24 dev eth0", "link set eth0 up", "link set lo up",
                      "link add nullrt type veth peer name nullrt-peer", "link set nullrt up",
                      f"route add default dev nullrt src {address}"]
            run(["ip", "-n", host, "-batch", "-"], input="\n".join(inside) + "\n")

    def _network_down(self, hosts: list[str]) -> None:
        for host in hosts:
            if Path(f"/run/netns/{host}").exists():
                run(["ip", "netns", "delete", host], check=False, timeout=10)
        veths = [f"v{h}" for h in hosts]
        for iface in [*veths, self.bridge]:
            if Path(f"/sys/class/net/{iface}").exists():
                run(["ip", "link", "delete", iface], check=False, timeout=10)
        # Namespaces are freed asynchronously; the host-side veths vanish with them.
        if not wait_for(lambda: not any(Path(f"/sys/class/net/{v}").exists() for v in veths),
                        STOP_TIMEOUT_S):
            left = [v for v in veths if Path(f"/sys/class/net/{v}").exists()]
            raise StageError("sandbox down", f"interfaces still present: {', '.join(left)}")

    # -------------------------------------------------------------- files
    def _write_files(self) -> None:
        for stale in ("state", "run", "log"):
            shutil.rmtree(self.root / stale, ignore_errors=True)
        for sub in ("etc", "state/ctld", "run", "log", "dev", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        etc = self.root / "etc"
        self._make_fake_gpus()
        (etc / "hosts").write_text(self._hosts_file())
        (etc / "nsswitch.conf").write_text(nsswitch_files_only())
        # For resolvers that skip nsswitch: fail fast instead of waiting for an unreachable server.
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        (etc / "plugstack.conf").write_text("")
        (etc / "slurm.conf").write_text(self._slurm_conf())
        (etc / "gres.conf").write_text(self._gres_conf())
        # slurmd 22.05 always initialises a cgroup plugin (even with linuxproc + task/none).
        (etc / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
        (etc / SETTINGS_FILE).write_text(json.dumps(self._settings(), indent=1) + "\n")

    def _make_fake_gpus(self) -> None:
        """GRES needs device files: character devices with /dev/null's numbers (1, 3)."""
        for i in range(self.gpus_per_node):
            gpu = self.root / "dev" / f"gpu{i}"
            if not gpu.exists():
                os.mknod(gpu, 0o666 | 0o020000, os.makedev(1, 3))

    def _hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost", f"{self.net}.1 {self.prefix}login"]
        lines += [f"{self.node_address(h)} {h}" for h in self.host_names()]
        return "\n".join(lines) + "\n"

    def _slurm_conf(self) -> str:
        r = self.root
        gres = f" Gres=gpu:{self.gpus_per_node}" if self.gpus_per_node else ""
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={self.node_address(n)} CPUs={self.cpus_per_node} "
            f"RealMemory={self.mem_mb}{gres} State=UNKNOWN" for n in self.node_names())
        return f"""\
# Generated by hpcserve.sandbox — Slurm 22.05 test cluster, rebuilt by every `up`.
ClusterName={self.prefix}sandbox
SlurmctldHost={self.controller}({self.node_address(self.controller)})
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state/ctld
SlurmdSpoolDir={r}/state/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={r}/etc/plugstack.conf
MailProg=/bin/true
# No cgroup-based plugins: nodes share one kernel and cgroup tree.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# No slurmdbd: plain sacct is disabled; `sacct -c` reads the jobcomp file.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={r}/log/jobcomp.txt
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
# Fast failure detection for tests. ReturnToService=1: a node that went DOWN for not responding
# returns when its slurmd registers, while an admin `state=down` stays down (2 would undo it).
ReturnToService=1
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=5
InactiveLimit=0
KillWait=5
MinJobAge=300
# Trust CPUs/RealMemory below although the machine has fewer.
SlurmdParameters=config_overrides
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _gres_conf(self) -> str:
        lines = ["AutoDetect=off"]
        if self.gpus_per_node:
            names = ",".join(self.node_names())
            files = f"{self.root}/dev/gpu[0-{self.gpus_per_node - 1}]"
            lines.append(f"NodeName={names} Name=gpu File={files}")
        return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ misc
def require_root() -> None:
    if os.geteuid() != 0:
        raise UsageError("the sandbox needs root (network namespaces, mounts, slurmd); run it as root")


def disable_ipv6_on(iface: str) -> None:
    path = Path(f"/proc/sys/net/ipv6/conf/{iface}/disable_ipv6")
    if path.exists():
        path.write_text("1\n")


def nsswitch_files_only() -> str:
    """The machine's nsswitch.conf with host lookups from files only (no DNS inside nodes)."""
    try:
        lines = Path("/etc/nsswitch.conf").read_text().splitlines()
    except OSError:
        lines = []
    lines = [ln for ln in lines if not ln.startswith("hosts:")] + ["hosts: files"]
    return "\n".join(lines) + "\n"


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
