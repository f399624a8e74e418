"""hpcserve's Python API. The CLI is a thin layer over these functions.

    up(config)      start a deployment (local: a detached driver; slurm: a batch job) and follow its
                    stages until it serves, fails, or the caller stops waiting
    down(name)      stop it; nothing stays running on any node
    status(name)    what is really running, checked now (process or job, endpoint health)
    logs(name)      the files of its run folder, by node and component
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
import yaml

from hpcserve import preflight
from hpcserve.config import DeploymentConfig, Layout, load_config
from hpcserve.errors import ConfigError, HpcserveError, StageError, UsageError
from hpcserve.state import (API_KEY_FILE, STATE_FILE, TIMELINE_FILE, Record, forget, list_names, load_record,
                            read_api_key, read_json, save_record)

FINAL = {"ready", "failed", "stopped", "checked"}


@dataclass
class Event:
    stage: str
    event: str
    detail: str
    time: float


@dataclass
class UpResult:
    name: str
    run_dir: Path
    status: str
    replicas: list[dict] = field(default_factory=list)
    answer: str | None = None
    api_key_source: str | None = None
    seconds: float = 0.0
    reason: str | None = None  # why it failed when the driver could not say (its job or process ended)


# ------------------------------------------------------------------ up

def prepare(config: str | Path | DeploymentConfig) -> tuple[DeploymentConfig, str]:
    """Load, validate and preflight; returns the config and the model path. Starts nothing."""
    cfg = config if isinstance(config, DeploymentConfig) else load_config(config)
    config_path = config if not isinstance(config, DeploymentConfig) else cfg.name
    if cfg.name in list_names() and is_running(load_record(cfg.name)):
        raise UsageError(f"a deployment named '{cfg.name}' is already running: `hpcserve down {cfg.name}` "
                         "first, or change 'name' in the config")
    preflight.check_scheduler(cfg)
    preflight.check_api_key(cfg)
    model_path = preflight.resolve_model_path(cfg)
    model_config = preflight.read_model_config(model_path)
    layout = cfg.parallelism if isinstance(cfg.parallelism, Layout) else None
    if layout and model_config:
        from hpcserve.serving.planner import check_config_layout

        problems = check_config_layout(cfg, model_config, layout)
        if problems:
            raise ConfigError(f"{config_path}: parallelism {layout.tensor}x{layout.pipeline}x{layout.replicas} "
                              f"(tensor x pipeline x replicas) cannot serve this model: {'; '.join(problems)}. "
                              "Run `hpcserve plan CONFIG` for a layout that fits")
    preflight.check_port(cfg, layout.replicas if layout else 1)
    return cfg, model_path


def up(config_path: str | Path | DeploymentConfig, on_event: Callable[[Event], None] | None = None,
       timeout_s: float | None = None) -> UpResult:
    cfg, _ = prepare(config_path)
    results = Path(cfg.results_dir).resolve()
    (results / "logs").mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    record = launch(cfg, results)
    save_record(record)
    try:
        result = follow(record, on_event, timeout_s or cfg.engine.startup_timeout_s + 600)
    except BaseException:  # a deadline, Ctrl-C: nothing half-started stays behind
        try:
            stop(record)
        except HpcserveError as cleanup:  # report it, but the original failure is the news
            print(f"while stopping after the failure: {cleanup}", file=sys.stderr)
        raise
    result.seconds = time.monotonic() - started
    if result.status != "ready":
        stop(record)
    return result


def launch(cfg: DeploymentConfig, results: Path, extra_env: dict[str, str] | None = None) -> Record:
    """Start the driver: detached on this machine, or as a Slurm batch job."""
    if cfg.cluster.scheduler == "local":
        return _start_local(cfg, results, extra_env or {})
    return _submit_slurm(cfg, results, extra_env or {})


def check(config_path: str | Path, on_event: Callable[[Event], None] | None = None) -> tuple[Path, dict | None]:
    """The distributed health check alone: Ray over the nodes, the check, everything stopped again."""
    from hpcserve.driver import CHECK_ONLY_ENV

    cfg = load_config(config_path)
    preflight.check_scheduler(cfg)
    results = Path(cfg.results_dir).resolve()
    (results / "logs").mkdir(parents=True, exist_ok=True)
    record = launch(cfg.model_copy(update={"name": f"{cfg.name}-check"}), results, {CHECK_ONLY_ENV: "1"})
    try:
        result = follow(record, on_event, timeout_s=600)
    finally:
        stop(record, grace_s=60)  # the driver stops Ray itself after the check; cancel only if it hangs
    return result.run_dir, read_json(result.run_dir / "health.json")


def _api_key_env(cfg: DeploymentConfig) -> tuple[dict[str, str], str | None]:
    """The endpoint's key for the driver's environment (never a command line or a script), and, when
    the named variable is empty, the key we generate for it (stored for clients by _store_key)."""
    name = cfg.serve.api_key_env
    if not name or os.environ.get(name):
        return {}, None
    key = secrets.token_urlsafe(32)
    return {name: key}, key


def _store_key(cfg: DeploymentConfig, run_dir: Path, generated: str | None) -> None:
    """A generated key goes into a file only we can read; api_key_source says where clients find it."""
    if generated:
        fd = os.open(run_dir / API_KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(generated)
        source = str(run_dir / API_KEY_FILE)
    else:
        source = f"${cfg.serve.api_key_env}" if cfg.serve.api_key_env else "none"
    (run_dir / "api_key_source").write_text(source + "\n")


def config_yaml(cfg: DeploymentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def _start_local(cfg: DeploymentConfig, results: Path, extra_env: dict[str, str]) -> Record:
    run_dir = results / "logs" / f"{cfg.name}-local-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(config_yaml(cfg))
    key_env, generated = _api_key_env(cfg)
    _store_key(cfg, run_dir, generated)
    with open(run_dir / "driver.log", "ab") as log:
        # A new session: the deployment outlives this command and the terminal it ran in.
        driver = subprocess.Popen([sys.executable, "-m", "hpcserve.driver", str(run_dir)], stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                  env={**os.environ, **extra_env, **key_env})
    return Record(name=cfg.name, scheduler="local", run_dir=str(run_dir), driver_pid=driver.pid,
                  driver_started=psutil.Process(driver.pid).create_time())


def _submit_slurm(cfg: DeploymentConfig, results: Path, extra_env: dict[str, str]) -> Record:
    from hpcserve.slurm.client import SlurmClient
    from hpcserve.slurm.render import render_batch_script

    script = render_batch_script(cfg, config_yaml(cfg), sys.executable, results)
    staging = results / "logs" / f".submit-{cfg.name}-{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    key_env, generated = _api_key_env(cfg)
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
    _store_key(cfg, run_dir, generated)
    return Record(name=cfg.name, scheduler="slurm", run_dir=str(run_dir), job_id=job_id)


def follow(record: Record, on_event: Callable[[Event], None] | None, timeout_s: float) -> UpResult:
    """Report each stage as the driver writes it, until a final status or the deadline."""
    run_dir = Path(record.run_dir)
    seen = 0
    deadline = time.monotonic() + timeout_s
    last_job_check = 0.0
    queued = None
    while True:
        timeline = read_json(run_dir / TIMELINE_FILE, []) or []
        for item in timeline[seen:]:
            if on_event:
                on_event(Event(item["stage"], item["event"], item.get("detail", ""), item["time"]))
        seen = len(timeline)
        state = read_json(run_dir / STATE_FILE, {}) or {}
        status = state.get("status")
        if status in FINAL:
            return _result(record, state)
        if time.monotonic() - last_job_check > 2:
            last_job_check = time.monotonic()
            gone = _runner_gone(record)
            queued = _report_queue(record, queued, on_event) if record.scheduler == "slurm" and not seen else queued
            if gone:
                state = read_json(run_dir / STATE_FILE, {}) or {}
                if state.get("status") in FINAL:
                    return _result(record, state)
                if on_event:
                    on_event(Event("driver", "failed", gone, time.time()))
                return UpResult(record.name, run_dir, "failed", reason=gone)
        if time.monotonic() > deadline:
            where = f" (job {record.job_id}: {queued})" if queued else ""
            raise StageError(state.get("stage", "submitted"), f"not ready after {timeout_s:.0f} s{where}",
                             str(run_dir / ("slurm.out" if record.scheduler == "slurm" else "driver.log")))
        time.sleep(0.3)


def _report_queue(record: Record, last: str | None, on_event) -> str | None:
    """While the job waits in the queue, say why (once per change): users otherwise stare at nothing."""
    info = _job(record)
    if info is None or not info.state.active:
        return last
    line = info.describe()
    if line != last and on_event and line.startswith("PENDING"):
        on_event(Event("queue", "waiting", line, time.time()))
    return line


def _result(record: Record, state: dict) -> UpResult:
    answers = (state.get("ready_check") or {}).get("answers") or {}
    answer = next(iter(answers.values()), None) if answers else None
    source = (Path(record.run_dir) / "api_key_source")
    return UpResult(record.name, Path(record.run_dir), state["status"], state.get("replicas") or [], answer,
                    source.read_text().strip() if source.exists() else None)


def _runner_gone(record: Record) -> str | None:
    """Why the driver can no longer make progress (its process or job is gone), else None."""
    if record.scheduler == "local":
        return None if _driver_process(record) else "the driver process exited (see driver.log)"
    info = _job(record)
    if info is None:
        return "the Slurm job is no longer known to Slurm"
    return None if not info.state.finished else f"the Slurm job ended: {info.describe()}"


# ------------------------------------------------------------------ down / stop

def down(name: str, timeout_s: float = 90.0) -> dict:
    record = load_record(name)
    left = stop(record, timeout_s)
    forget(name)
    return {"name": name, "run_dir": record.run_dir, "left_running": left}


def stop(record: Record, timeout_s: float = 90.0, grace_s: float = 0.0) -> list[int]:
    """Stop a deployment; returns PIDs still alive afterwards (on this machine), which should be none.

    grace_s: first give a driver that is finishing on its own this long to end by itself.
    """
    if record.scheduler == "slurm":
        _cancel_job(record, timeout_s, grace_s)
        return []
    driver = _driver_process(record)
    if driver and grace_s:
        psutil.wait_procs([driver], timeout=grace_s)
    return _stop_local(record, timeout_s)


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
    info = _job(record)
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


def _job(record: Record):
    from hpcserve.errors import SlurmError
    from hpcserve.slurm.client import SlurmClient

    try:
        return SlurmClient().job(record.job_id)
    except SlurmError:
        return None


# ------------------------------------------------------------------ status

@dataclass
class DeploymentStatus:
    name: str
    scheduler: str
    status: str  # what the driver last wrote, corrected by what is alive now
    stage: str | None
    runner: str  # the driver process or the Slurm job, checked now
    run_dir: str
    replicas: list[dict]
    error: dict | None
    job_id: str | None = None


def is_running(record: Record) -> bool:
    return _runner_gone(record) is None


def status(name: str | None = None) -> list[DeploymentStatus]:
    from hpcserve.serving.readiness import health_ok

    names = [name] if name else list_names()
    out = []
    for n in names:
        record = load_record(n)
        state = read_json(Path(record.run_dir) / STATE_FILE, {}) or {}
        gone = _runner_gone(record)
        current = state.get("status", "submitted")
        if gone and current not in ("failed", "stopped"):
            current = "dead"  # the file says otherwise, but nothing is running: say so
        replicas = []
        for rep in state.get("replicas") or []:
            live = (not gone) and health_ok(rep["url"])
            replicas.append({**rep, "healthy": live})
        if current == "ready" and replicas and not all(r["healthy"] for r in replicas):
            current = "degraded"
        runner = gone or (f"driver pid {record.driver_pid}" if record.scheduler == "local" else _job_line(record))
        out.append(DeploymentStatus(n, record.scheduler, current, state.get("stage"), runner, record.run_dir,
                                    replicas, state.get("error"), record.job_id))
    return out


def _job_line(record: Record) -> str:
    info = _job(record)
    return f"job {record.job_id}: {info.describe()}" if info else f"job {record.job_id}: unknown to Slurm"


# ------------------------------------------------------------------ logs

COMPONENTS = {
    "driver": ["driver.log"],
    "slurm": ["slurm.out", "job.sbatch"],
    "ray": ["nodes/*/ray-start.log", "nodes/*/launch.log", "nodes/*/ray/*.log", "nodes/*/ray/*.out"],
    "engine": ["engines/*.log"],
    "health": ["health.json", "nccl.*.log"],
    "monitor": ["monitor/*.jsonl"],
    "timeline": ["timeline.json", "state.json"],
}


def log_files(name: str, node: str | None = None, component: str | None = None) -> list[Path]:
    record = load_record(name)
    run_dir = Path(record.run_dir)
    if component and component not in COMPONENTS:
        raise UsageError(f"unknown component '{component}': choose one of {', '.join(COMPONENTS)}")
    patterns = COMPONENTS[component] if component else [p for ps in COMPONENTS.values() for p in ps]
    files = sorted({f for p in patterns for f in run_dir.glob(p) if f.is_file()})
    if node:
        files = [f for f in files if node in f.relative_to(run_dir).parts or node in f.name]
    return files


def api_key_for(name: str) -> str | None:
    """The key clients send to this deployment (from the environment variable or the generated file)."""
    record = load_record(name)
    cfg = load_config(Path(record.run_dir) / "config.yaml")
    env = cfg.serve.api_key_env
    if env and os.environ.get(env):
        return os.environ[env]
    return read_api_key(record.run_dir)


__all__ = ["up", "down", "status", "log_files", "prepare", "api_key_for", "load_record", "HpcserveError"]
