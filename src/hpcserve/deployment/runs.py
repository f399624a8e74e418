"""Where a deployment's process runs and how it is stopped: a detached process on this machine (the
driver in local mode, or the endpoint controller), or a Slurm batch job whose script execs the driver.

    launch(cfg, results)    start it; returns the Record that finds it again
    runner_gone(record)     why it can no longer make progress (process exited, job ended), else None
    stop(record)            orderly stop (SIGTERM: it stops what it started), then by recorded PID
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

from hpcserve.core.config import DeploymentConfig
from hpcserve.core.state import API_KEY_FILE, API_KEY_SOURCE_FILE, Record

DRIVER = "hpcserve.deployment.driver"
ENDPOINT = "hpcserve.endpoint.process"


def launch(cfg: DeploymentConfig, results: Path, extra_env: dict[str, str] | None = None,
           module: str = DRIVER) -> Record:
    """Start the driver (detached on this machine, or as a Slurm batch job), or the endpoint controller
    (always here: it outlives the jobs it launches)."""
    if cfg.cluster.scheduler == "local" or module == ENDPOINT:
        return start_local(cfg, results, extra_env or {}, module)
    return submit_slurm(cfg, results, extra_env or {})


def api_key_env(cfg: DeploymentConfig) -> tuple[dict[str, str], str | None]:
    """The endpoint's key for the driver's environment (never a command line or a script), and, when
    the named variable is empty, the key we generate for it (stored for clients by _store_key)."""
    name = cfg.serve.api_key_env
    if not name or os.environ.get(name):
        return {}, None
    key = secrets.token_urlsafe(32)
    return {name: key}, key


def store_key(cfg: DeploymentConfig, run_dir: Path, generated: str | None) -> None:
    """A generated key goes into a file only we can read; api_key_source says where clients find it."""
    if generated:
        fd = os.open(run_dir / API_KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(generated)
        source = str(run_dir / API_KEY_FILE)
    else:
        source = f"${cfg.serve.api_key_env}" if cfg.serve.api_key_env else "none"
    (run_dir / API_KEY_SOURCE_FILE).write_text(source + "\n")


def config_yaml(cfg: DeploymentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def start_local(cfg: DeploymentConfig, results: Path, extra_env: dict[str, str], module: str = DRIVER) -> Record:
    kind = "endpoint" if module == ENDPOINT else "local"
    run_dir = results / "logs" / f"{cfg.name}-{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(config_yaml(cfg))
    key_env, generated = api_key_env(cfg)
    store_key(cfg, run_dir, generated)
    with open(run_dir / own_log(module), "ab") as log:
        # A new session: the deployment outlives this command and the terminal it ran in.
        process = subprocess.Popen([sys.executable, "-m", module, str(run_dir)], stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                   env={**os.environ, **extra_env, **key_env})
    return Record(name=cfg.name, scheduler=cfg.cluster.scheduler, run_dir=str(run_dir), driver_pid=process.pid,
                  driver_started=psutil.Process(process.pid).create_time(),
                  kind="endpoint" if module == ENDPOINT else "driver")


def own_log(module: str) -> str:
    return "endpoint.log" if module == ENDPOINT else "driver.log"


def log_name(record: Record) -> str:
    """The file in the run folder where the deployment's own process writes."""
    if record.job_id:
        return "slurm.out"
    return own_log(ENDPOINT if record.kind == "endpoint" else DRIVER)


def submit_slurm(cfg: DeploymentConfig, results: Path, extra_env: dict[str, str]) -> Record:
    from hpcserve.slurm.client import SlurmClient
    from hpcserve.slurm.render import render_batch_script

    script = render_batch_script(cfg, config_yaml(cfg), sys.executable, results)
    staging = results / "logs" / f".submit-{cfg.name}-{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    key_env, generated = api_key_env(cfg)
    extra_env = {**extra_env, **key_env}
    saved = {k: os.environ.get(k) for k in extra_env}
    os.environ.update(extra_env)  # sbatch exports the submitter's environment (not the script) to the job
    try:
        job_id = SlurmClient().submit(script, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a refused submission leaves nothing behind
        raise
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    run_dir = results / "logs" / f"{cfg.name}-{job_id}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (staging / "job.sbatch").replace(run_dir / "job.sbatch")
    staging.rmdir()
    store_key(cfg, run_dir, generated)
    return Record(name=cfg.name, scheduler="slurm", run_dir=str(run_dir), job_id=job_id)


def runner_gone(record: Record) -> str | None:
    """Why the driver can no longer make progress (its process or job is gone), else None."""
    if record.job_id is None:
        return None if _driver_process(record) else f"the {record.kind} process exited (see {log_name(record)})"
    info = job_info(record)
    if info is None:
        return "the Slurm job is no longer known to Slurm"
    return None if not info.state.finished else f"the Slurm job ended: {info.describe()}"


def stop(record: Record, timeout_s: float = 90.0, grace_s: float = 0.0) -> list[int]:
    """Stop a deployment; returns PIDs still alive afterwards (on this machine), which should be none.

    grace_s: first give a driver that is finishing on its own this long to end by itself.
    """
    if record.job_id is not None:
        _cancel_job(record, timeout_s, grace_s)
        return []
    driver = _driver_process(record)
    if driver and grace_s:
        psutil.wait_procs([driver], timeout=grace_s)
    left = _stop_local(record, timeout_s)
    if record.kind == "endpoint":
        left += _stop_orphaned_members(record, timeout_s)
    return left


def _stop_orphaned_members(record: Record, timeout_s: float) -> list[int]:
    """The endpoint stops its members itself; if it was killed before it could, stop them here."""
    from hpcserve.core.state import STATE_FILE, read_json

    state = read_json(Path(record.run_dir) / STATE_FILE, {}) or {}
    router_pid = (state.get("endpoint") or {}).get("pid")
    if router_pid:
        from hpcserve.endpoint.router import stop_router

        stop_router(router_pid)  # checks that the PID is still our router
    left = []
    for member in state.get("members") or []:
        member_record = Record(**member["record"])
        if runner_gone(member_record) is None:
            left += stop(member_record, timeout_s)
    return left


def _stop_local(record: Record, timeout_s: float) -> list[int]:
    driver = _driver_process(record)
    if driver is None:
        return []
    tree = [driver] + driver.children(recursive=True)
    driver.terminate()  # the driver stops engines, then Ray, in order
    _, alive = psutil.wait_procs([driver], timeout=timeout_s)
    survivors = [p for p in tree if _alive(p)]
    for proc in survivors:  # whatever the orderly stop missed: by PID, recorded before
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(survivors, timeout=10)
    return [p.pid for p in still]


def _cancel_job(record: Record, timeout_s: float, grace_s: float = 0.0) -> None:
    from hpcserve.slurm.client import JobWaitTimeout, SlurmClient
    from hpcserve.slurm.states import JobState

    client = SlurmClient()
    info = job_info(record)
    if info is None or info.state.finished:
        return
    if grace_s:
        try:
            if client.wait_for(record.job_id, lambda j: j.state.finished, timeout=grace_s, poll=0.5).state.finished:
                return
        except JobWaitTimeout:
            pass
    if info.state is JobState.PENDING:  # nothing runs yet: a signal has nowhere to go
        client.cancel(record.job_id)
        client.wait_for(record.job_id, lambda j: j.state.finished, timeout=timeout_s, poll=0.5)
        return
    # TERM to the batch shell alone: the driver stops engines, then Ray, in order (TERM to every step
    # at once kills the Ray head under the driver's feet). If it hangs past the deadline, a plain
    # scancel lets Slurm kill everything.
    client.cancel(record.job_id, signal="TERM", batch_only=True)
    try:
        client.wait_for(record.job_id, lambda j: j.state.finished, timeout=timeout_s, poll=0.5)
    except JobWaitTimeout:
        client.cancel(record.job_id)
        client.wait_for(record.job_id, lambda j: j.state.finished, timeout=60, poll=0.5)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _driver_process(record: Record) -> psutil.Process | None:
    if not record.driver_pid:
        return None
    try:
        proc = psutil.Process(record.driver_pid)
        if record.driver_started and abs(proc.create_time() - record.driver_started) > 1:
            return None  # the PID was reused by another process
        return proc if _alive(proc) else None
    except psutil.NoSuchProcess:
        return None


def queue_line(record: Record) -> str | None:
    """The job's state in one line while Slurm still holds it ("PENDING (Resources)", "RUNNING on ..."),
    else None (finished, unknown, or no job)."""
    info = job_info(record)
    return info.describe() if info is not None and info.state.active else None


def job_info(record: Record):
    from hpcserve.core.errors import SlurmError
    from hpcserve.slurm.client import SlurmClient

    if not record.job_id:
        return None
    try:
        return SlurmClient().job(record.job_id)
    except SlurmError:
        return None
