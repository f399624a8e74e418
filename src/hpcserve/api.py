"""hpcserve's Python API. The CLI is a thin layer over these functions.

    up(config)      start a deployment and follow its stages until it serves, fails, or the caller stops
                    waiting. With serve.router (the default) that is the endpoint controller on this
                    machine, which launches the replicas' drivers (Slurm jobs or local processes);
                    without, the driver itself (local: a detached process; slurm: a batch job)
    down(name)      stop it; nothing stays running on any node
    status(name)    what is really running, checked now (process or job, endpoint health)
    logs(name)      the files of its run folder, by node and component
    endpoints(target)  the OpenAI endpoints of a deployment (or a URL), with its key
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hpcserve.core.config import DeploymentConfig, Layout, load_config
from hpcserve.core.errors import (
    ConfigError,
    HpcserveError,
    NotFoundError,
    StageError,
    UsageError,
)
from hpcserve.core.files import read_json
from hpcserve.core.keys import choose_key, key_source, read_api_key, remove_secrets
from hpcserve.core.osenv import PRIVATE_UMASK, umask
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import Record, forget, list_names, load_record, save_record
from hpcserve.core.runstate import RunState, read_timeline
from hpcserve.core.statuses import RunKind, RunStatus, Stage, StageEvent
from hpcserve.core.timeline import stage_breakdown
from hpcserve.deployment import preflight
from hpcserve.deployment.driver import CHECK_ONLY_ENV
from hpcserve.deployment.runs import launch, run_of
from hpcserve.deployment.watch import StartWatch
from hpcserve.endpoint.members import Member
from hpcserve.endpoint.run import start_endpoint, stop_endpoint
from hpcserve.engine.client import Endpoint, health_ok
from hpcserve.monitoring.metrics import Gatherer
from hpcserve.planning.planner import check_config_layout

FOLLOW_POLL_S = 0.3


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
    status: RunStatus
    replicas: list[dict] = field(default_factory=list)
    answer: str | None = None
    api_key_source: str | None = None
    seconds: float = 0.0
    reason: str | None = None  # why it failed when the driver could not say (its job or process ended)
    stages: dict = field(default_factory=dict)  # where the time went: timeline.stage_breakdown
    endpoint: str | None = None  # the router's URL, when there is one
    error: dict | None = None  # the failed stage, its diagnosis and the log to read


# ------------------------------------------------------------------ up

def prepare(config: str | Path | DeploymentConfig) -> tuple[DeploymentConfig, str]:
    """Load, validate and preflight; returns the config and the model path. Starts nothing."""
    cfg = config if isinstance(config, DeploymentConfig) else load_config(config)
    config_path = config if not isinstance(config, DeploymentConfig) else cfg.name
    if cfg.name in list_names() and is_running(load_record(cfg.name)):
        raise UsageError(f"a deployment named '{cfg.name}' is already running: `hpcserve down {cfg.name}` "
                         "first, or change 'name' in the config")
    preflight.check_scheduler(cfg)
    preflight.check_folders(cfg)  # nobody else can plant files where the run's processes read them
    model_path = preflight.resolve_model_path(cfg)
    preflight.check_weights_here(cfg, model_path)  # local scheduler: the weights must be here to serve
    model_config = preflight.model_config_for(cfg, model_path)
    layout = cfg.parallelism if isinstance(cfg.parallelism, Layout) else None
    if layout and model_config:
        problems = check_config_layout(cfg, model_config, layout)
        if problems:
            raise ConfigError(f"{config_path}: parallelism {layout.tensor}x{layout.pipeline}x{layout.replicas} "
                              f"(tensor x pipeline x replicas) cannot serve this model: {'; '.join(problems)}. "
                              "Run `hpcserve plan CONFIG` for a layout that fits")
    preflight.check_port(cfg, (layout.replicas if layout else 1) + (1 if cfg.serve.router else 0))
    return cfg, model_path


@umask(PRIVATE_UMASK)  # run folders, their files and the registry's records: for their owner alone
def up(config_path: str | Path | DeploymentConfig, on_event: Callable[[Event], None] | None = None,
       timeout_s: float | None = None) -> UpResult:
    cfg, _ = prepare(config_path)
    results = Path(cfg.results_dir).resolve()
    key = choose_key(cfg.serve.api_key_env, cfg.serve.insecure_no_api_key)  # every deployment has one
    started = time.monotonic()
    record = start_endpoint(cfg, results, key) if cfg.serve.router else launch(cfg, results, key)
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
    if result.status is not RunStatus.READY:
        stop(record)
    return result


@umask(PRIVATE_UMASK)
def check(config_path: str | Path, on_event: Callable[[Event], None] | None = None) -> tuple[Path, dict | None]:
    """The distributed health check alone: Ray over the nodes, the check, everything stopped again."""
    cfg = load_config(config_path)
    preflight.check_scheduler(cfg)
    preflight.check_folders(cfg)
    results = Path(cfg.results_dir).resolve()
    key = choose_key(cfg.serve.api_key_env, cfg.serve.insecure_no_api_key)  # unused by a check: removed with it
    record = launch(cfg.model_copy(update={"name": f"{cfg.name}-check"}), results, key, {CHECK_ONLY_ENV: "1"})
    try:
        result = follow(record, on_event, timeout_s=600)
    finally:
        run_of(record).stop(grace_s=60)  # the driver stops Ray itself after the check; cancel only if it hangs
        remove_secrets(record.run_dir)
    return result.run_dir, read_json(RunPaths(result.run_dir).health)


def follow(record: Record, on_event: Callable[[Event], None] | None, timeout_s: float) -> UpResult:
    """Report each stage as the driver writes it, until a final status or the deadline."""
    watch = StartWatch(record, check_every_s=2.0)
    deadline = time.monotonic() + timeout_s
    report = on_event or (lambda event: None)
    while True:
        for item in watch.new_events():
            report(Event(item["stage"], item["event"], item.get("detail", ""), item["time"]))
        seen = watch.observe()
        if seen.state.status.final:
            return _result(record, seen.state)
        if seen.queue and seen.queue.startswith("PENDING"):  # users otherwise stare at nothing
            report(Event(Stage.QUEUE, StageEvent.WAITING, seen.queue, time.time()))
        if seen.gone:
            report(Event(Stage.DRIVER, StageEvent.FAILED, seen.gone, time.time()))
            return UpResult(record.name, Path(record.run_dir), RunStatus.FAILED, reason=seen.gone)
        if time.monotonic() > deadline:
            where = f" (job {record.job_id}: {watch.queue})" if watch.queue else ""
            raise StageError(seen.state.stage or Stage.SUBMITTED, f"not ready after {timeout_s:.0f} s{where}",
                             str(run_of(record).log))
        time.sleep(FOLLOW_POLL_S)


def _result(record: Record, state: RunState) -> UpResult:
    timeline = read_timeline(record.run_dir)
    return UpResult(record.name, Path(record.run_dir), state.status, state.replicas, state.first_answer,
                    key_source(record.run_dir),
                    stages=stage_breakdown(timeline, record.created, state.job_started),
                    endpoint=state.endpoint_url, error=state.error.to_dict() if state.error else None)


# ------------------------------------------------------------------ down / stop

def stop(record: Record, timeout_s: float = 90.0) -> list[int]:
    """Stop a deployment; returns PIDs still alive afterwards (on this machine), which should be none."""
    try:
        if record.kind is RunKind.ENDPOINT:
            return stop_endpoint(record, timeout_s)
        return run_of(record).stop(timeout_s)
    finally:
        remove_secrets(record.run_dir)  # a stopped deployment keeps no copy of its key or Ray's token


def down(name: str, timeout_s: float = 90.0) -> dict:
    record = load_record(name)
    if record.kind is RunKind.ENDPOINT:
        timeout_s += 90.0  # it stops its members (each up to a minute, in parallel), then the router
    left = stop(record, timeout_s)
    forget(name)
    return {"name": name, "run_dir": record.run_dir, "left_running": left}


# ------------------------------------------------------------------ status

@dataclass
class DeploymentStatus:
    name: str
    scheduler: str
    status: RunStatus  # what the driver last wrote, corrected by what is alive now
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
    return run_of(record).gone() is None


def status(name: str | None = None) -> list[DeploymentStatus]:
    return [deployment_status(load_record(n)) for n in ([name] if name else list_names())]


def deployment_status(record: Record) -> DeploymentStatus:
    state = RunState.read(record.run_dir)
    run = run_of(record)
    gone = run.gone()
    current = state.status
    if gone and not current.ended:
        current = RunStatus.DEAD  # the file says otherwise, but nothing is running: say so
    replicas = [{**rep, "healthy": (not gone) and health_ok(rep["url"])} for rep in state.replicas]
    if current is RunStatus.READY and replicas and not all(r["healthy"] for r in replicas):
        current = RunStatus.DEGRADED
    stages = stage_breakdown(read_timeline(record.run_dir), record.created, state.job_started)
    return DeploymentStatus(record.name, record.scheduler, current, state.stage, gone or run.runner_line(),
                            record.run_dir, replicas, state.error.to_dict() if state.error else None,
                            record.job_id, stages, state.endpoint_url,
                            [member_line(Member.from_json(m)) for m in state.members],
                            [d.to_dict() for d in state.decisions])


def member_line(member: Member) -> dict:
    """What status shows of a member: name, role, state, where it runs, its replicas."""
    record = member.as_record()
    return {"name": member.name, "role": member.role, "status": member.status, "group": member.group,
            "runner": f"job {record.job_id}" if record.job_id else f"pid {record.driver_pid}",
            "backends": member.backends, "ready_s": member.ready_s, "note": member.note,
            "run_dir": record.run_dir, "error": member.error}


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
    paths = RunPaths(Path(record.run_dir))
    if component and component not in COMPONENTS:
        raise UsageError(f"unknown component '{component}': choose one of {', '.join(COMPONENTS)}")
    patterns = COMPONENTS[component] if component else [p for ps in COMPONENTS.values() for p in ps]
    # An endpoint's members keep their run folders inside its own (members/logs/NAME-...).
    folders = [paths.root, *paths.member_run_dirs()]
    files = sorted({f for d in folders for p in patterns for f in d.glob(p) if f.is_file()})
    if node:
        files = [f for f in files if node in f.relative_to(paths.root).parts or node in f.name]
    return files


# ------------------------------------------------------------------ clients

def api_key_for(name: str) -> str | None:
    """The key clients send to this deployment (from the generated file or the environment variable)."""
    return read_api_key(load_record(name).run_dir)


def gatherer(name: str, max_age_s: float = 1.0) -> Gatherer:
    """Live metrics of one deployment (replicas' /metrics, nodes' samples) for the dashboard and --watch."""
    return Gatherer(name, status_fn=lambda n: status(n)[0], key_fn=_key_or_none, max_age_s=max_age_s)


def _key_or_none(name: str) -> str | None:
    try:
        return api_key_for(name)
    except (HpcserveError, OSError):
        return None


def endpoints(target: str, api_key: str | None = None) -> list[Endpoint]:
    """A deployment name gives its endpoint (the router, when ready) or its replicas; a URL gives itself."""
    if target.startswith(("http://", "https://")):
        return [Endpoint(target.rstrip("/").removesuffix("/v1"), None, api_key)]
    record = load_record(target)
    state = RunState.read(record.run_dir)
    key = api_key or read_api_key(record.run_dir)
    model = state.replicas[0].get("model") if state.replicas else None
    if state.endpoint_url and state.status is RunStatus.READY:  # one URL in front of every replica
        return [Endpoint(state.endpoint_url, model, key)]
    if not state.replicas:
        raise NotFoundError(f"deployment '{target}' has no endpoint yet (stage: {state.stage or 'unknown'}); "
                            f"see `hpcserve status {target}`")
    return [Endpoint(r["url"], r.get("model"), key) for r in state.replicas]


__all__ = ["up", "down", "status", "log_files", "prepare", "api_key_for", "endpoints", "load_record",
           "HpcserveError", "Event", "UpResult", "DeploymentStatus", "RunStatus"]
