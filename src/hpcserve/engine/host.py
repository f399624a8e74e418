"""EngineHost: a Ray actor that runs one vLLM process on the node Ray placed it on.

The actor holds the node's share of the replica's resources (its placement-group bundle), so Ray's
CUDA_VISIBLE_DEVICES reaches vLLM; the vLLM process is our child in its own process group, stopped by
that group (TERM, then KILL), and dies with the actor (PR_SET_PDEATHSIG) if the actor dies first.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
NODE_GPUS_ENV = "HPCSERVE_NODE_CUDA_VISIBLE_DEVICES"  # set by raycluster/node.py from the allocation


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class EngineHost:
    """Use through ray.remote(EngineHost).options(...) — see engine/replicas.py."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def where(self) -> dict:
        import ray

        return {"hostname": socket.gethostname(), "address": ray.util.get_node_ip_address(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "node_id": ray.get_runtime_context().get_node_id()}

    def start(self, argv: list[str], env: dict[str, str], log_path: str, node_gpus: bool = False) -> int:
        """node_gpus: show the process the GPUs of the node's allocation, not the (none) Ray gave this actor."""
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **env}
        if node_gpus:
            full_env.pop("CUDA_VISIBLE_DEVICES", None)
            if os.environ.get(NODE_GPUS_ENV):
                full_env["CUDA_VISIBLE_DEVICES"] = os.environ[NODE_GPUS_ENV]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=full_env, start_new_session=True, preexec_fn=_die_with_parent)
        return self.proc.pid

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # The group may hold vLLM's workers even after the main process exited.
        _signal_group(self.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.proc.returncode


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
