"""EngineHost: a Ray actor that runs one vLLM process on the node Ray placed it on.

The actor holds the node's share of the replica's resources (its placement-group bundle), so Ray's
CUDA_VISIBLE_DEVICES reaches vLLM; the vLLM process is our child in its own process group, stopped by
that group (TERM, then KILL), and dies with the actor (PR_SET_PDEATHSIG) if the actor dies first.

The vLLM process must start like a plain `vllm serve` typed in the job, not like a Ray worker. A Ray
worker (Ray 2.60) differs from a job process in ways that slow vLLM's API and engine-core processes:
- niceness 15 (Ray's `worker_niceness`, "so that the OS prioritizes CPU for other processes"), which
  the child inherits;
- OMP_NUM_THREADS forced to floor(num_cpus) or 1 when unset (ray/_private/utils.py,
  set_omp_num_threads_if_unset): 1 for the 0.01-CPU host of the Ray executor;
- oom_score_adj 1000 (Ray's `worker_oom_score_adjustment`): first in line for the OOM killer;
- per-worker variables (RAY_JOB_ID, RAY_RAYLET_PID, CUDA_VISIBLE_DEVICES of the actor's bundle).
The node's raylet was started from the job's environment, so it is the reference: the engine gets the
raylet's environment (less what `ray start` adds for Ray's own daemons), niceness and oom_score_adj,
plus our settings. vLLM's own Ray workers are left as Ray makes them, as under a plain `vllm serve`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from hpcserve.core.osenv import PRIVATE_UMASK

PR_SET_PDEATHSIG = 1
NODE_GPUS_ENV = "HPCSERVE_NODE_CUDA_VISIBLE_DEVICES"  # set by raycluster/node.py from the allocation
# `ray start` preloads Ray's jemalloc into its daemons (not into workers) and marks it with this one.
RAY_JEMALLOC_MARK = "RAY_LD_PRELOAD_ON_WORKERS"


@dataclass(frozen=True)
class JobProcess:
    """What a process started in the job has on this node, read from the node's raylet."""

    env: dict[str, str]
    nice: int | None = None
    oom_score_adj: int | None = None


def engine_environment(job_env: dict[str, str] | None, worker_env: dict[str, str], overrides: dict[str, str],
                       node_gpus: bool) -> dict[str, str]:
    """The vLLM process's environment: the job's (or, unknown, this Ray worker's), our overrides on top. Pure.

    node_gpus: the process sees the node's GPUs (Ray executor: vLLM reserves its GPUs itself), else the
    GPUs Ray gave this actor's bundle (mp executor).
    """
    env = dict(worker_env) if job_env is None else _without_ray_daemon_settings(job_env)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    gpus = _visible_gpus(job_env or {}, worker_env, node_gpus)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    env.update(overrides)
    return env


def _without_ray_daemon_settings(job_env: dict[str, str]) -> dict[str, str]:
    env = dict(job_env)
    if RAY_JEMALLOC_MARK in env:  # LD_PRELOAD is Ray's jemalloc, which Ray itself keeps out of workers
        env.pop("LD_PRELOAD", None)
        env.pop("MALLOC_CONF", None)
        env.pop(RAY_JEMALLOC_MARK)
    return env


def _visible_gpus(job_env: dict[str, str], worker_env: dict[str, str], node_gpus: bool) -> str | None:
    if not node_gpus:
        return worker_env.get("CUDA_VISIBLE_DEVICES")
    # Unset (None) when the allocation named none: the process then sees every GPU of the node.
    return worker_env.get(NODE_GPUS_ENV) or job_env.get(NODE_GPUS_ENV) or None


def read_job_process(raylet_pid: str | None) -> JobProcess | None:
    """The raylet's environment, niceness and oom_score_adj; None where they cannot be read."""
    if not raylet_pid:
        return None
    try:
        raylet = psutil.Process(int(raylet_pid))
        env, nice = raylet.environ(), raylet.nice()
    except Exception:  # noqa: BLE001 - gone, not ours, a bad pid: fall back to the worker's settings
        return None
    return JobProcess(env=env, nice=nice, oom_score_adj=_read_int(f"/proc/{raylet_pid}/oom_score_adj"))


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def _child_setup(job: JobProcess | None):
    """Runs in the child between fork and exec: die with the actor; take the job's priority back."""
    nice = job.nice if job else None
    oom = job.oom_score_adj if job else None

    def setup() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        # Best effort: lowering niceness needs CAP_SYS_NICE or RLIMIT_NICE; where it is refused the
        # engine keeps Ray's, and engine_process() shows it.
        if nice is not None:
            _quietly(lambda: os.setpriority(os.PRIO_PROCESS, 0, nice))
        if oom is not None:
            _quietly(lambda: Path("/proc/self/oom_score_adj").write_text(str(oom)))

    return setup


def _quietly(action) -> None:
    try:
        action()
    except OSError:
        pass


class EngineHost:
    """Use through ray.remote(EngineHost).options(...) — see engine/replicas.py."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.settings_from = ""  # "raylet" (the job's) or "ray worker" (raylet unreadable)

    def where(self) -> dict:
        import ray

        return {"hostname": socket.gethostname(), "address": ray.util.get_node_ip_address(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "node_id": ray.get_runtime_context().get_node_id()}

    def start(self, argv: list[str], env: dict[str, str], log_path: str, node_gpus: bool = False) -> int:
        """node_gpus: show the process the GPUs of the node's allocation, not the (none) Ray gave this actor."""
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        job = read_job_process(os.environ.get("RAY_RAYLET_PID"))
        self.settings_from = "raylet" if job else "ray worker"
        full_env = engine_environment(job.env if job else None, dict(os.environ), env, node_gpus)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=full_env, start_new_session=True, umask=PRIVATE_UMASK,
                                         preexec_fn=_child_setup(job))  # noqa: PLW1509 - PDEATHSIG needs it
        return self.proc.pid

    def engine_process(self) -> dict:
        """How the engine process runs (for diagnosis): niceness, oom_score_adj, CPU affinity."""
        if self.proc is None:
            return {}
        pid = self.proc.pid
        try:
            return {"pid": pid, "settings_from": self.settings_from, "nice": os.getpriority(os.PRIO_PROCESS, pid),
                    "oom_score_adj": _read_int(f"/proc/{pid}/oom_score_adj"),
                    "cpus": len(os.sched_getaffinity(pid))}
        except OSError:
            return {"pid": pid}

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
