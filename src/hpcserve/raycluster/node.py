"""The Ray node process: `python -m hpcserve.raycluster.node head|worker ...`, one per node.

Runs on the node itself (launched by srun, or directly in local mode) so that what only the node can
know is decided there:
- its address: for a worker, the source address the kernel uses to reach the head, i.e. the NIC that
  really connects the two (users' pitfall #1: on multi-NIC nodes Ray guesses wrong and placement
  groups never place);
- its temp dir: per node and per run, short (Unix socket paths are limited to 107 bytes), mode 0700 and
  checked to be ours (on a shared /tmp another user could have made it, or a link named like it, first);
- its logs: when Ray stops, the node's Ray logs are copied into the shared run folder (links are copied
  as links, never followed: they could lead to any file this user may read).
CPU and GPU counts come from the allocation (arguments), never from Ray's autodetection.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpcserve.core.errors import UnsafePathError
from hpcserve.core.folders import private_dir
from hpcserve.core.osenv import PRIVATE_UMASK
from hpcserve.raycluster.nodefiles import TMP_SUBDIR, close_open_folders


def address_towards(host: str, port: int) -> str:
    """The local address the kernel would use to reach host:port (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        return sock.getsockname()[0]


def own_address(head: str | None) -> str:
    if head:
        host, port = head.rsplit(":", 1)
        return address_towards(host, int(port))
    return socket.gethostbyname(socket.gethostname())


def ray_start_argv(args: argparse.Namespace, address: str, temp_dir: Path) -> list[str]:
    ray = str(Path(sys.executable).with_name("ray"))
    if not Path(ray).exists():  # images with /usr/bin/python3 and a pip-installed /usr/local/bin/ray
        ray = shutil.which("ray") or ray
    argv = [ray, "start", "--block", "--disable-usage-stats", f"--node-ip-address={address}",
            f"--num-cpus={args.num_cpus}", f"--num-gpus={args.num_gpus}", f"--temp-dir={temp_dir}",
            f"--dashboard-agent-listen-port={args.agent_port}",
            # The log monitor streams every worker's output to drivers: ours take none (log_to_driver=False),
            # the files stay in the node's session folder. One Python process (2-5 s of CPU) fewer per node.
            "--include-log-monitor=false"]
    if args.role == "head":
        # No autoscaler monitor: a Slurm allocation's nodes are fixed, and nothing of ours reads its state
        # (`ray status`); one Python process (1-2 s of CPU, and a poll every few seconds) fewer per head.
        argv += ["--head", f"--port={args.gcs_port}", f"--ray-client-server-port={args.client_port}",
                 "--include-dashboard=false", "--no-monitor"]
    else:
        argv += [f"--address={args.head}"]
    return argv


def wait_for_tcp(address: str, deadline_s: float) -> None:
    """A worker must not start before the head listens: poll it, up to a deadline (no fixed sleep)."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"head {address} not reachable after {deadline_s:.0f} s")
            time.sleep(0.2)


STOP_FILE = "stop"
CLOSE_EVERY_S = 5.0  # Ray's folders closed again this often (nodefiles.py: Ray opens them as it makes them)


def wait_for_exit_or_stop(child: subprocess.Popen, stop_file: Path, every=lambda: None) -> int:
    """Until Ray exits; a stop file written by the driver (shared filesystem) stops it first. Signals
    cannot be used for that: srun turns them into a kill after KillWait, before the logs are copied.
    every: called about every CLOSE_EVERY_S meanwhile, and once at once."""
    next_call = 0.0
    while True:
        if time.monotonic() >= next_call:
            every()
            next_call = time.monotonic() + CLOSE_EVERY_S
        try:
            return child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if stop_file.exists():
                child.send_signal(signal.SIGTERM)
                return child.wait()


def copy_logs(temp_dir: Path, dest: Path) -> None:
    logs = temp_dir / "session_latest" / "logs"
    if logs.is_dir():
        shutil.copytree(logs, dest / "ray", symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.sock", "*.err.*"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hpcserve.raycluster.node")
    parser.add_argument("role", choices=["head", "worker"])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--temp-root", required=True, type=Path)
    parser.add_argument("--num-cpus", required=True, type=int)
    parser.add_argument("--num-gpus", required=True, type=int)
    parser.add_argument("--gcs-port", type=int)
    parser.add_argument("--client-port", type=int)
    parser.add_argument("--agent-port", required=True, type=int)
    parser.add_argument("--head", help="HEAD_ADDRESS:PORT, for workers")
    parser.add_argument("--address", help="this node's address (default: detected)")
    parser.add_argument("--join-timeout", type=float, default=120)
    return parser.parse_args(argv)


def private_temp_dir(temp_root: Path, hostname: str) -> Path:
    """TEMP_ROOT/HOSTNAME for this node's Ray: the root may be made by another node first (a /tmp shared
    between nodes), so it must only be ours; the node's own folder is new."""
    return private_dir(private_dir(temp_root) / hostname, fresh=True)


def main(argv: list[str] | None = None) -> int:
    os.umask(PRIVATE_UMASK)  # Ray's session files and sockets, and the logs copied back: ours alone
    args = parse_args(argv)
    hostname = socket.gethostname()
    node_dir = args.run_dir / "nodes" / hostname
    node_dir.mkdir(parents=True, exist_ok=True)
    if args.role == "worker":
        wait_for_tcp(args.head, args.join_timeout)
    address = args.address or own_address(args.head if args.role == "worker" else None)
    try:
        temp_dir = private_temp_dir(args.temp_root, hostname)
    except UnsafePathError as exc:
        raise SystemExit(f"Ray's temp folder: {exc}") from None
    # vLLM and NCCL pick the node's address the same flawed way Ray does: tell them.
    os.environ["VLLM_HOST_IP"] = address
    # Every temporary file under Ray (vLLM's IPC sockets, rendezvous files) in this node's private folder,
    # removed with it: nothing of the deployment in the shared /tmp (nodefiles.py).
    os.environ["TMPDIR"] = str(private_dir(temp_dir / TMP_SUBDIR, fresh=True))
    # Ray rewrites CUDA_VISIBLE_DEVICES per worker; keep the allocation's value for processes that
    # must see the node's GPUs (vLLM's API process with the Ray executor).
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        os.environ["HPCSERVE_NODE_CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    argv_ray = ray_start_argv(args, address, temp_dir)
    with open(node_dir / "ray-start.log", "ab") as log:
        child = subprocess.Popen(argv_ray, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    info = {"hostname": hostname, "address": address, "role": args.role, "pid": os.getpid(),
            "ray_pid": child.pid, "temp_dir": str(temp_dir), "argv": argv_ray, "started": time.time()}
    (node_dir / "node.json").write_text(json.dumps(info, indent=2))

    def forward(signum, _frame):
        child.send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes on TERM

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = wait_for_exit_or_stop(child, node_dir / STOP_FILE, lambda: close_open_folders(temp_dir))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # Ray has stopped: a second TERM must not cut the clean-up
    try:
        copy_logs(temp_dir, node_dir)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
        try:
            os.rmdir(args.temp_root)  # once the last node of this machine is done with it
        except OSError:
            pass
    return code


if __name__ == "__main__":
    sys.exit(main())
