"""hpcserve's Python API. The CLI is a thin layer over these functions.

    up(config)      start a deployment and follow its stages until it serves, fails, or the caller stops
                    waiting. With serve.router (the default) that is the endpoint controller on this
                    machine, which launches the replicas' drivers (Slurm jobs or local processes);
                    without, the driver itself (local: a detached process; slurm: a batch job)
    down(name)      stop it; nothing stays running on any node
    status(name)    what is really running, checked now (process or job, endpoint health)
    logs(name)      the files of its run folder, by node and component
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hpcserve.deployment import preflight
from hpcserve.core.config import DeploymentConfig, Layout, load_config
from hpcserve.core.errors import ConfigError, HpcserveError, StageError, UsageError
from hpcserve.deployment.runs import ENDPOINT, job_info, launch, log_name, queue_line, runner_gone, stop
from hpcserve.core.state import (API_KEY_SOURCE_FILE, STATE_FILE, TIMELINE_FILE, Record, forget, list_names,
                            load_record, read_api_key, read_json, save_record)
from hpcserve.core.timeline import stage_breakdown

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
    stages: dict = field(default_factory=dict)  # where the time went: timeline.stage_breakdown
    endpoint: str | None = None  # the router's URL, when there is one


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
    preflight.check_weights_here(cfg, model_path)  # local scheduler: the weights must be here to serve
    model_config = preflight.model_config_for(cfg, model_path)
    layout = cfg.parallelism if isinstance(cfg.parallelism, Layout) else None
    if layout and model_config:
        from hpcserve.planning.planner import check_config_layout

        problems = check_config_layout(cfg, model_config, layout)
        if problems:
            raise ConfigError(f"{config_path}: parallelism {layout.tensor}x{layout.pipeline}x{layout.replicas} "
                              f"(tensor x pipeline x replicas) cannot serve this model: {'; '.join(problems)}. "
                              "Run `hpcserve plan CONFIG` for a layout that fits")
    preflight.check_port(cfg, (layout.replicas if layout else 1) + (1 if cfg.serve.router else 0))
    return cfg, model_path


def up(config_path: str | Path | DeploymentConfig, on_event: Callable[[Event], None] | None = None,
       timeout_s: float | None = None) -> UpResult:
    cfg, _ = prepare(config_path)
    results = Path(cfg.results_dir).resolve()
    (results / "logs").mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    record = launch(cfg, results, module=ENDPOINT) if cfg.serve.router else launch(cfg, results)
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


def check(config_path: str | Path, on_event: Callable[[Event], None] | None = None) -> tuple[Path, dict | None]:
    """The distributed health check alone: Ray over the nodes, the check, everything stopped again."""
    from hpcserve.deployment.driver import CHECK_ONLY_ENV

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
            gone = runner_gone(record)
            queued = _report_queue(record, queued, on_event) if record.job_id and not seen else queued
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
                             str(run_dir / log_name(record)))
        time.sleep(0.3)


def _report_queue(record: Record, last: str | None, on_event) -> str | None:
    """While the job waits in the queue, say why (once per change): users otherwise stare at nothing."""
    line = queue_line(record)
    if line is None:
        return last
    if line != last and on_event and line.startswith("PENDING"):
        on_event(Event("queue", "waiting", line, time.time()))
    return line


def _result(record: Record, state: dict) -> UpResult:
    answers = (state.get("ready_check") or {}).get("answers") or {}
    answer = next(iter(answers.values()), None) if answers else None
    source = Path(record.run_dir) / API_KEY_SOURCE_FILE
    timeline = read_json(Path(record.run_dir) / TIMELINE_FILE, []) or []
    return UpResult(record.name, Path(record.run_dir), state["status"], state.get("replicas") or [], answer,
                    source.read_text().strip() if source.exists() else None,
                    stages=stage_breakdown(timeline, record.created, state.get("job_started")),
                    endpoint=(state.get("endpoint") or {}).get("url"))


# ------------------------------------------------------------------ down / stop

def down(name: str, timeout_s: float = 90.0) -> dict:
    record = load_record(name)
    if record.kind == "endpoint":
        timeout_s += 90.0  # it stops its members (each up to a minute, in parallel), then the router
    left = stop(record, timeout_s)
    forget(name)
    return {"name": name, "run_dir": record.run_dir, "left_running": left}


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
    stages: dict = field(default_factory=dict)  # where up's time went: timeline.stage_breakdown
    endpoint: str | None = None  # the router's URL (serve.router)
    members: list[dict] = field(default_factory=list)  # the deployments behind the router, one line each
    decisions: list[dict] = field(default_factory=list)  # the endpoint's last decisions, with reasons


def is_running(record: Record) -> bool:
    return runner_gone(record) is None


def status(name: str | None = None) -> list[DeploymentStatus]:
    from hpcserve.engine.client import health_ok

    names = [name] if name else list_names()
    out = []
    for n in names:
        record = load_record(n)
        state = read_json(Path(record.run_dir) / STATE_FILE, {}) or {}
        gone = runner_gone(record)
        current = state.get("status", "submitted")
        if gone and current not in ("failed", "stopped"):
            current = "dead"  # the file says otherwise, but nothing is running: say so
        replicas = []
        for rep in state.get("replicas") or []:
            live = (not gone) and health_ok(rep["url"])
            replicas.append({**rep, "healthy": live})
        if current == "ready" and replicas and not all(r["healthy"] for r in replicas):
            current = "degraded"
        runner = gone or (f"{record.kind} pid {record.driver_pid}" if record.job_id is None else _job_line(record))
        timeline = read_json(Path(record.run_dir) / TIMELINE_FILE, []) or []
        stages = stage_breakdown(timeline, record.created, state.get("job_started"))
        endpoint = (state.get("endpoint") or {}).get("url")
        members = [member_line(m) for m in state.get("members") or []]
        out.append(DeploymentStatus(n, record.scheduler, current, state.get("stage"), runner, record.run_dir,
                                    replicas, state.get("error"), record.job_id, stages, endpoint, members,
                                    state.get("decisions") or []))
    return out


def member_line(member: dict) -> dict:
    """What status shows of a member: name, role, state, where it runs, its replicas."""
    record = member["record"]
    return {"name": member["name"], "role": member["role"], "status": member["status"], "group": member.get("group", 0),
            "runner": f"job {record['job_id']}" if record.get("job_id") else f"pid {record.get('driver_pid')}",
            "backends": member.get("backends") or [], "ready_s": member.get("ready_s"), "note": member.get("note", ""),
            "run_dir": record["run_dir"], "error": member.get("error")}


def _job_line(record: Record) -> str:
    info = job_info(record)
    return f"job {record.job_id}: {info.describe()}" if info else f"job {record.job_id}: unknown to Slurm"


# ------------------------------------------------------------------ logs

COMPONENTS = {
    "driver": ["driver.log", "endpoint.log", "router.log"],
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
    # An endpoint's members keep their run folders inside its own (members/logs/NAME-...).
    folders = [run_dir, *sorted(p for p in run_dir.glob("members/logs/*") if p.is_dir())]
    files = sorted({f for d in folders for p in patterns for f in d.glob(p) if f.is_file()})
    if node:
        files = [f for f in files if node in f.relative_to(run_dir).parts or node in f.name]
    return files


def api_key_for(name: str) -> str | None:
    """The key clients send to this deployment (from the generated file or the environment variable)."""
    return read_api_key(load_record(name).run_dir)


__all__ = ["up", "down", "status", "log_files", "prepare", "api_key_for", "load_record", "HpcserveError"]
