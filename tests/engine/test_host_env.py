"""The vLLM process starts like a plain `vllm serve` in the job, not like the Ray worker that hosts it:
the job's environment (read from the node's raylet), niceness and oom_score_adj (engine/host.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from hpcserve.engine.host import (
    NODE_GPUS_ENV,
    RAY_JEMALLOC_MARK,
    JobProcess,
    _child_setup,
    engine_environment,
    read_job_process,
)
from hpcserve.testing.harness import wait_until

JOB = {"PATH": "/usr/bin", "HOME": "/home/u", "VLLM_HOST_IP": "10.0.0.5", "CUDA_VISIBLE_DEVICES": "0,1",
       NODE_GPUS_ENV: "0,1"}
# What Ray 2.60 makes of it in the worker of an EngineHost with num_cpus=0.01 and no GPU.
WORKER = {**JOB, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "RAY_JOB_ID": "01000000",
          "RAY_RAYLET_PID": "4242"}


def test_the_job_environment_not_the_ray_workers():
    env = engine_environment(JOB, WORKER, {"VLLM_API_KEY": "k", "RAY_ADDRESS": "10.0.0.5:6379"}, node_gpus=True)
    assert "OMP_NUM_THREADS" not in env  # Ray's 1 thread for a 0.01-CPU actor does not reach vLLM
    assert "RAY_JOB_ID" not in env and "RAY_RAYLET_PID" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"  # the node's GPUs: vLLM's Ray executor reserves its own
    assert env["VLLM_HOST_IP"] == "10.0.0.5" and env["VLLM_API_KEY"] == "k" and env["RAY_ADDRESS"] == "10.0.0.5:6379"


def test_a_thread_count_set_in_the_job_is_kept():
    job = {**JOB, "OMP_NUM_THREADS": "8"}
    assert engine_environment(job, {**WORKER, "OMP_NUM_THREADS": "8"}, {}, node_gpus=True)["OMP_NUM_THREADS"] == "8"


def test_overrides_win():
    env = engine_environment(JOB, WORKER, {"OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "1"}, node_gpus=True)
    assert env["OMP_NUM_THREADS"] == "4" and env["CUDA_VISIBLE_DEVICES"] == "1"


def test_rays_jemalloc_preload_stays_with_rays_daemons():
    job = {**JOB, "LD_PRELOAD": "/venv/ray/core/libjemalloc.so", RAY_JEMALLOC_MARK: "0"}
    env = engine_environment(job, WORKER, {}, node_gpus=True)
    assert "LD_PRELOAD" not in env and RAY_JEMALLOC_MARK not in env


def test_a_users_own_preload_is_kept():
    job = {**JOB, "LD_PRELOAD": "/opt/site/libfoo.so"}  # Ray adds its jemalloc only when none is set
    assert engine_environment(job, WORKER, {}, node_gpus=True)["LD_PRELOAD"] == "/opt/site/libfoo.so"


def test_no_allocation_gpus_means_every_gpu_of_the_node():
    job = {k: v for k, v in JOB.items() if k not in ("CUDA_VISIBLE_DEVICES", NODE_GPUS_ENV)}
    worker = {k: v for k, v in WORKER.items() if k != NODE_GPUS_ENV}
    assert "CUDA_VISIBLE_DEVICES" not in engine_environment(job, worker, {}, node_gpus=True)


def test_mp_executor_keeps_the_gpus_ray_gave_the_bundle():
    worker = {**WORKER, "CUDA_VISIBLE_DEVICES": "1"}
    assert engine_environment(JOB, worker, {}, node_gpus=False)["CUDA_VISIBLE_DEVICES"] == "1"


def test_raylet_unreadable_falls_back_to_the_worker_environment():
    env = engine_environment(None, WORKER, {"X": "1"}, node_gpus=True)
    assert env["OMP_NUM_THREADS"] == "1" and env["X"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_read_job_process_of_a_real_process():
    # A child of our own with a known environment (a pytest-xdist worker's own was set after its start)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             env={"PATH": os.defpath, "HPCSERVE_PROBE": "1"})
    try:
        # Until the child has exec'd, /proc shows what it had after the fork (seen in CI: no PATH yet)
        wait_until(lambda: psutil.Process(child.pid).environ().get("HPCSERVE_PROBE") == "1", 10, "the child's exec")
        job = read_job_process(str(child.pid))
        assert job is not None and job.env["PATH"] == os.defpath and job.env["HPCSERVE_PROBE"] == "1"
        assert job.nice == os.getpriority(os.PRIO_PROCESS, child.pid)
    finally:
        child.communicate(timeout=30)
    assert read_job_process(None) is None and read_job_process("not-a-pid") is None
    assert read_job_process("999999999") is None  # no such process


def test_child_takes_the_given_niceness():
    """Raising niceness needs no privilege, so a real child shows the mechanism anywhere."""
    target = min(os.getpriority(os.PRIO_PROCESS, 0) + 3, 19)
    probe = "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         preexec_fn=_child_setup(JobProcess(env={}, nice=target)))
    assert int(out.stdout) == target


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering niceness needs CAP_SYS_NICE")
def test_child_gets_the_job_niceness_back_from_a_niced_parent():
    probe = "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"
    niced = [sys.executable, "-c", "import os, subprocess, sys; os.nice(15); "
             "from hpcserve.engine.host import JobProcess, _child_setup; "
             f"subprocess.run([sys.executable, '-c', {probe!r}], "
             f"preexec_fn=_child_setup(JobProcess(env={{}}, nice={os.getpriority(os.PRIO_PROCESS, 0)})))"]
    out = subprocess.run(niced, capture_output=True, text=True, check=True)
    assert int(out.stdout) == os.getpriority(os.PRIO_PROCESS, 0)
