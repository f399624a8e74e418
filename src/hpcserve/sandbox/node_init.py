"""PID 1 of one sandbox host: prepares the host's private view of the machine, then runs its daemon.

Started by `Sandbox` inside fresh network + PID + mount + UTS namespaces:

    nsenter --net=/run/netns/NAME -- unshare --pid --fork --mount-proc --uts ... -- \\
        python -m hpcserve.sandbox.node_init NAME --root ROOT -- slurmd -D -f ROOT/etc/slurm.conf

It gives the host its own hostname, /sys, /dev/shm, /etc/hosts and name resolution (the rest of the
file system, /tmp included, stays shared, like NFS on a real cluster), starts the daemon and then stays
alive reaping orphans. It does not exit when the daemon dies: a crashed slurmd leaves its jobs running,
as on a real node. SIGKILL of this process is a node crash: the kernel kills everything on the node.

Only the standard library is imported here: four of these run for the whole life of a sandbox.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMON_STOP_GRACE_S = 5.0


def log(message: str) -> None:
    print(f"[node_init {socket.gethostname()}] {message}", file=sys.stderr, flush=True)


def mount(*args: str) -> None:
    """Run mount(8); a failure here means the node cannot work, so say exactly what failed."""
    done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=10, check=False)
    if done.returncode != 0:
        raise SystemExit(f"mount {' '.join(args)} failed: {done.stdout}{done.stderr}".strip())


def record_pid_namespace(root: Path, name: str) -> None:
    """Write this node's PID-namespace id, so the host can find every process of the node later,
    even after this init has died (see hosts.node_pids)."""
    marker = root / "run" / f"{name}.pidns"
    marker.write_text(os.readlink("/proc/self/ns/pid") + "\n")


def mount_private_sysfs(root: Path, name: str) -> None:
    """A sysfs of this network namespace (own /sys/class/net), with the host's cgroup tree kept.

    slurmd 22.05 initialises a cgroup plugin even with task/none + proctrack/linuxproc and exits
    when /sys/fs/cgroup is missing, so the host's cgroup mounts are parked aside and moved back in.
    """
    parking = root / "run" / f"cgroup.{name}"
    parking.mkdir(parents=True, exist_ok=True)
    mount("--rbind", "/sys/fs/cgroup", str(parking))
    mount("-t", "sysfs", "sysfs", "/sys")
    mount("--move", str(parking), "/sys/fs/cgroup")


def mount_name_resolution(root: Path) -> None:
    """Names come from the sandbox hosts file only: the host's DNS server is unreachable from a node
    and every lookup of an unknown name would otherwise wait for it (about 6 s)."""
    etc = root / "etc"
    mount("--bind", str(etc / "hosts"), "/etc/hosts")
    mount("--bind", str(etc / "nsswitch.conf"), "/etc/nsswitch.conf")
    mount("--bind", str(etc / "resolv.conf"), "/etc/resolv.conf")


def disable_ipv6() -> None:
    """IPv4 only inside the node: no link-local chatter, no IPv6 address for tools to pick."""
    for scope in ("all", "default"):
        path = Path(f"/proc/sys/net/ipv6/conf/{scope}/disable_ipv6")
        if path.exists():
            path.write_text("1\n")


def prepare_node(root: Path, name: str) -> None:
    socket.sethostname(name)
    record_pid_namespace(root, name)
    mount_private_sysfs(root, name)
    mount_name_resolution(root)
    mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm")  # per-node shared memory
    disable_ipv6()


def record_daemon_pid(root: Path, name: str, pid: int) -> None:
    """Write the daemon's PID (in this namespace), so the host can tell the daemon from the processes
    it forks (see hosts.daemon_pid). Replaced whole, so it is never read half-written."""
    partial = root / "run" / f"{name}.daemon.partial"
    partial.write_text(f"{pid}\n")
    os.replace(partial, root / "run" / f"{name}.daemon")


def stop_daemon_and_exit(daemon: subprocess.Popen) -> None:
    """SIGTERM: give the daemon a moment to shut down cleanly; our exit then ends the node."""
    try:
        daemon.terminate()
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + DAEMON_STOP_GRACE_S
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(daemon.pid, os.WNOHANG)
        except ChildProcessError:
            break  # already reaped by the main loop
        if pid:
            break
        time.sleep(0.1)
    sys.exit(0)


def reap_forever(daemon: subprocess.Popen, name: str) -> None:
    """As PID 1 every orphan of the node (slurmstepd, job processes) becomes our child: reap them."""
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            signal.pause()  # nothing left to reap: sleep until a signal (PEP 475 retries os.wait)
            continue
        if pid == daemon.pid:
            log(f"daemon {name} exited ({status:#x}); the node keeps running")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="host name of this node (= Slurm NodeName)")
    parser.add_argument("--root", required=True, type=Path, help="sandbox directory")
    parser.epilog = "Then `-- DAEMON ARGS...`: the daemon to run, in the foreground."
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.error("give the daemon to run after --")
    split = argv.index("--")
    args, daemon_argv = parser.parse_args(argv[:split]), argv[split + 1:]
    if os.getpid() != 1:
        parser.error("must run as PID 1 of a new PID namespace (see Sandbox)")

    prepare_node(args.root, args.name)
    daemon = subprocess.Popen(daemon_argv, stdin=subprocess.DEVNULL)
    record_daemon_pid(args.root, args.name, daemon.pid)
    log(f"started {' '.join(daemon_argv)} as pid {daemon.pid}")
    # PID 1 only receives signals it has a handler for (SIGKILL from the host always works).
    signal.signal(signal.SIGTERM, lambda *_: stop_daemon_and_exit(daemon))
    signal.signal(signal.SIGINT, lambda *_: stop_daemon_and_exit(daemon))
    reap_forever(daemon, daemon_argv[0])


if __name__ == "__main__":
    main()
