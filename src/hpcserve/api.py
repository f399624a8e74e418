"""hpcserve's Python API. The CLI is a thin layer over these functions.

    up(config)      start a deployment and follow its stages until it serves, fails, or the caller stops
                    waiting. With serve.router (the default) that is the endpoint controller on this
                    machine, which launches the replicas' drivers (Slurm jobs or local processes);
                    without, the driver itself (local: a detached process; slurm: a batch job)
    down(name)      stop it; nothing stays running on any node
    adopt(name)     a new controller for an endpoint whose controller is gone: it adopts the router and
                    replicas that still run (`up` of the same config does the same)
    status(name)    what is really running, checked now (process or job, endpoint health)
    logs(name)      the files of its run folder, by node and component
    endpoints(target)  the OpenAI endpoints of a deployment (or a URL), with its key
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hpcserve.core.config import DeploymentConfig, Layout, config_differences, load_config
from hpcserve.core.errors import (
    ConfigError,
    HpcserveError,
    NotFoundError,
    StageError,
    UsageError,
)
from hpcserve.core.files import exclusive, read_json, read_secret
from hpcserve.core.keys import choose_key, key_source, read_api_key, remove_secrets
from hpcserve.core.osenv import PRIVATE_UMASK, umask
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import Record, forget, list_names, load_record, save_record
from hpcserve.core.runstate import RunState, read_timeline
from hpcserve.core.statuses import MemberStatus, RunKind, RunStatus, Stage, StageEvent
from hpcserve.core.timeline import stage_breakdown
from hpcserve.deployment import preflight
from hpcserve.deployment.runs import CHECK_ONLY_ENV, expected_start, launch, run_of
from hpcserve.deployment.watch import StartWatch
from hpcserve.endpoint.handover import last_run_startup
from hpcserve.endpoint.holding import holding_now
from hpcserve.endpoint.members import Member, member_config, single_replica
from hpcserve.endpoint.run import (
    EndpointCheck,
    MemberCheck,
    adopt_endpoint,
    inspect_endpoint,
    start_endpoint,
    stop_endpoint,
)
from hpcserve.core.net import is_loopback, port_free
from hpcserve.engine.client import Endpoint, health_ok
from hpcserve.monitoring.metrics import Gatherer
from hpcserve.planning import model_source
from hpcserve.planning.planner import check_config_layout
from hpcserve.raycluster.nodefiles import remove_run_node_folders
from hpcserve.slurm.parse import time_limit_seconds

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
    adopted: list[dict] | None = None  # adopting: the new controller's decisions (None: a fresh start)


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
    model_path = model_source.resolve_model_path(cfg)
    model_source.check_weights_here(cfg, model_path)  # local scheduler: the weights must be here to serve
    model_config = model_source.model_config_for(cfg, model_path)
    layout = cfg.parallelism if isinstance(cfg.parallelism, Layout) else None
    if layout and model_config:
        problems = check_config_layout(cfg, model_config, layout)
        if problems:
            raise ConfigError(f"{config_path}: parallelism {layout.tensor}x{layout.pipeline}x{layout.replicas} "
                              f"(tensor x pipeline x replicas) cannot serve this model: {'; '.join(problems)}. "
                              "Run `hpcserve plan CONFIG` for a layout that fits")
    preflight.check_port(cfg, (layout.replicas if layout else 1) + (1 if cfg.serve.router else 0))
    preflight.check_walltime(handover_room(cfg, model_path, layout), str(config_path))
    return cfg, model_path


def handover_room(cfg: DeploymentConfig, model_path: str, layout: Layout | None):
    """What the walltime leaves to serve behind an endpoint on Slurm: Slurm's queue estimate for one member
    now (sbatch --test-only, nothing queued) and the startup measured in this deployment's last run, else
    estimated (deployment.preflight.walltime_check)."""
    if not cfg.hands_over or time_limit_seconds(cfg.cluster.time) is None:
        return None
    results = Path(cfg.results_dir).resolve()
    member = member_config(cfg, f"{cfg.name}-m0", 0, single_replica(layout or Layout()), results)
    measured = last_run_startup(results, cfg.name)
    return preflight.walltime_check(cfg, model_path, expected_start(member, results), time.time(),
                                    (measured.seconds, measured.basis) if measured else None)


@umask(PRIVATE_UMASK)  # run folders, their files and the registry's records: for their owner alone
def up(config_path: str | Path | DeploymentConfig, on_event: Callable[[Event], None] | None = None,
       timeout_s: float | None = None) -> UpResult:
    """Start the deployment; an endpoint of this name whose controller is gone while its router or
    replicas run is adopted instead (no running replica restarted), if the config is the running one."""
    cfg = config_path if isinstance(config_path, DeploymentConfig) else load_config(config_path)
    if adoptable(cfg.name):
        return adopt(cfg.name, cfg, on_event)
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


def follow(record: Record, on_event: Callable[[Event], None] | None, timeout_s: float,
           seen_events: int = 0) -> UpResult:
    """Report each stage as the driver writes it, until a final status or the deadline. seen_events:
    timeline events already there (an adopted endpoint's), not reported again."""
    watch = StartWatch(record, check_every_s=2.0, seen=seen_events)
    deadline = time.monotonic() + timeout_s
    report = on_event or (lambda event: None)
    while True:
        for item in watch.new_events():
            report(Event(item["stage"], item["event"], item.get("detail", ""), item["time"]))
        seen = watch.observe()
        fresh = written_by(record, seen.state)
        if seen.state.status.final and fresh:
            return _result(record, seen.state)
        if seen.queue and seen.queue.startswith("PENDING"):  # users otherwise stare at nothing
            report(Event(Stage.QUEUE, StageEvent.WAITING, seen.queue, time.time()))
        gone = seen.gone if fresh else run_of(record).gone()  # the watch skips a run whose file looks final
        if gone:
            report(Event(Stage.DRIVER, StageEvent.FAILED, gone, time.time()))
            return UpResult(record.name, Path(record.run_dir), RunStatus.FAILED, reason=gone)
        if time.monotonic() > deadline:
            where = f" (job {record.job_id}: {watch.queue})" if watch.queue else ""
            raise StageError(seen.state.stage or Stage.SUBMITTED, f"not ready after {timeout_s:.0f} s{where}",
                             str(run_of(record).log))
        time.sleep(FOLLOW_POLL_S)


def written_by(record: Record, state: RunState) -> bool:
    """state.json is this process's word, not what a predecessor in the same run folder wrote last."""
    return not record.driver_pid or state.driver_pid in (None, record.driver_pid)


def _result(record: Record, state: RunState) -> UpResult:
    timeline = read_timeline(record.run_dir)
    return UpResult(record.name, Path(record.run_dir), state.status, state.replicas, state.first_answer,
                    key_source(record.run_dir),
                    stages=stage_breakdown(timeline, record.created, state.job_started),
                    endpoint=state.endpoint_url, error=state.error.to_dict() if state.error else None)


# ------------------------------------------------------------------ adopt

ADOPT_TIMEOUT_S = 600.0  # a real completion per replica, a router start: seconds; a loaded site: more


def adoptable(name: str) -> bool:
    """A registered endpoint of this name whose controller is gone while its router or replicas run."""
    if name not in list_names():
        return False
    record = load_record(name)
    return record.kind is RunKind.ENDPOINT and not is_running(record) and inspect_endpoint(record).survivors


@umask(PRIVATE_UMASK)  # the new controller's files, like up's
def adopt(name: str, config: str | Path | DeploymentConfig | None = None,
          on_event: Callable[[Event], None] | None = None, timeout_s: float = ADOPT_TIMEOUT_S) -> UpResult:
    """A new controller for endpoint `name` whose controller is gone: it adopts the router (or starts one
    on the same port with the same key) and every member whose job runs and whose replicas answer a real
    completion; lost members are replaced as usual. Every check that can refuse runs before anything
    starts (UsageError, exit 2). With its controller running there is nothing to adopt (idempotent: a
    crontab line can call it). With `config`, it must be the running one."""
    paths = RunPaths(Path(load_record(name).run_dir))
    with exclusive(paths.adopt_lock):
        record = load_record(name)  # again, under the lock: another adopt may have started one meanwhile
        state = RunState.read(record.run_dir)
        if record.kind is RunKind.ENDPOINT and is_running(record):
            return UpResult(name, paths.root, RunStatus.READY, state.replicas, endpoint=state.endpoint_url,
                            reason=f"its controller runs ({run_of(record).runner_line()}): nothing to adopt",
                            adopted=[])
        running = check_adoptable(record, state, inspect_endpoint(record, state))
        if config is not None:
            check_same_config(running, config if isinstance(config, DeploymentConfig) else load_config(config),
                              paths.config)
        check_same_key(running, record.run_dir)
        started, seen = time.time(), len(read_timeline(record.run_dir))  # the predecessor's events: not news
        new = adopt_endpoint(record)
        save_record(new)
    # No cleanup if following fails: the new controller adopting is the repair, and one whose adoption
    # fails leaves what ran as it was (endpoint/process.py).
    result = follow(new, on_event, timeout_s, seen_events=seen)
    result.adopted = [d.to_dict() for d in RunState.read(record.run_dir).decisions if d.time >= started]
    return result


def check_adoptable(record: Record, state: RunState, check: EndpointCheck) -> DeploymentConfig:
    """Refuse what cannot be adopted, before anything starts; returns the running config."""
    name = record.name
    if record.kind is not RunKind.ENDPOINT:
        raise UsageError(f"'{name}' has no endpoint (serve.router: false): there is no controller to adopt it; "
                         f"`hpcserve status {name}` tells what runs")
    if not check.survivors:
        raise UsageError(f"nothing of '{name}' runs any more (no router, no member's job): nothing to adopt. "
                         f"`hpcserve down {name}`, then `hpcserve up CONFIG`")
    if not any(e["stage"] == Stage.READY for e in read_timeline(record.run_dir)):
        raise UsageError(f"'{name}' lost its controller before it was ready: nothing served yet, so adopting "
                         f"saves nothing. `hpcserve down {name}`, then `hpcserve up CONFIG`")
    running = load_config(RunPaths(Path(record.run_dir)).config)
    host = "127.0.0.1" if is_loopback(running.serve.host) else running.serve.host
    if not check.router_serving and not port_free(running.serve.port, host):
        raise UsageError(f"the router of '{name}' is gone and port {running.serve.port} is taken by another "
                         "program: a new router cannot start there. Free the port, then adopt again")
    return running


def check_same_config(running: DeploymentConfig, given: DeploymentConfig, copy: Path) -> None:
    """Adopting applies no change: a config that differs would leave members of two shapes behind one
    endpoint, or a router on a port the config no longer names."""
    differences = config_differences(running, given)
    if differences:
        raise UsageError(f"'{running.name}' runs with another config than the one given, and adopting changes "
                         f"nothing that runs. Differences: {'; '.join(differences[:8])}. Adopt it as it runs "
                         f"(`hpcserve adopt {running.name}`; its config: {copy}), or `hpcserve down "
                         f"{running.name}` and `hpcserve up` the new config")


def check_same_key(running: DeploymentConfig, run_dir: str) -> None:
    """The running router and engines check the key in the run folder's key file; a different one in the
    environment would lock clients (and the controller) out."""
    variable = running.serve.api_key_env
    given = os.environ.get(variable or "", "")
    key_file = RunPaths(Path(run_dir)).router_key
    if given and key_file.is_file() and given != read_secret(key_file):
        raise UsageError(f"${variable} holds another key than the one the running endpoint checks: adopting "
                         f"with it would lock clients out. Export the key it was started with, or unset "
                         f"{variable} (the running key is read from the run folder)")


# ------------------------------------------------------------------ down / stop

def stop(record: Record, timeout_s: float = 90.0) -> list[int]:
    """Stop a deployment; returns PIDs still alive afterwards (on this machine), which should be none."""
    try:
        if record.kind is RunKind.ENDPOINT:
            return stop_endpoint(record, timeout_s)
        return run_of(record).stop(timeout_s)
    finally:
        remove_secrets(record.run_dir)  # a stopped deployment keeps no copy of its key or Ray's token
        remove_run_node_folders(record.run_dir)  # what its nodes left in /tmp, killed members' too


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
    advice: str | None = None  # what to run to put it right (an endpoint without its controller)
    holding: dict | None = None  # no replica takes requests: held now, since when, the members waited for

    def to_json(self) -> dict:
        """Plain JSON values (statuses and paths as text): what `hpcserve status --json` prints."""
        return json.loads(json.dumps(self.__dict__, default=str))


def is_running(record: Record) -> bool:
    return run_of(record).gone() is None


def status(name: str | None = None) -> list[DeploymentStatus]:
    return [deployment_status(load_record(n)) for n in ([name] if name else list_names())]


def deployment_status(record: Record) -> DeploymentStatus:
    state = RunState.read(record.run_dir)
    run = run_of(record)
    gone = run.gone()
    if gone and record.kind is RunKind.ENDPOINT:
        check = inspect_endpoint(record, state)
        if check.survivors:
            return uncontrolled_status(record, state, check)
    current = state.status
    if gone and not current.ended:
        current = RunStatus.DEAD  # the file says otherwise, but nothing is running: say so
    replicas = [{**rep, "healthy": (not gone) and health_ok(rep["url"])} for rep in state.replicas]
    if current is RunStatus.READY and replicas and not all(r["healthy"] for r in replicas):
        current = RunStatus.DEGRADED
    stages = stage_breakdown(read_timeline(record.run_dir), record.created, state.job_started)
    members = [member_line(Member.from_json(m)) for m in state.members]
    decisions = [d.to_dict() for d in state.decisions]
    # What clients get, asked of the data plane: the controller's file says ready while a late successor
    # leaves the pool empty (endpoint/holding.py)
    hold = (holding_now(RunPaths(Path(record.run_dir)).router_admin, members, decisions)
            if record.kind is RunKind.ENDPOINT and current in (RunStatus.READY, RunStatus.DEGRADED) else None)
    return DeploymentStatus(record.name, record.scheduler, RunStatus.HOLDING if hold else current, state.stage,
                            gone or run.runner_line(), record.run_dir, replicas,
                            state.error.to_dict() if state.error else None, record.job_id, stages,
                            state.endpoint_url, members, decisions, holding=hold)


def uncontrolled_status(record: Record, state: RunState, check: EndpointCheck) -> DeploymentStatus:
    """An endpoint whose controller is gone while its router or replicas run: what the controller last
    wrote no longer holds, so each part is shown as checked now (the router's PID and port, each member's
    job and replicas), with the command that brings control back."""
    answering = {url for m in check.members for url in m.answering}
    router = (f"router pid {check.router_pid} serving on {state.endpoint_url}" if check.router_serving
              else f"router gone (pid {check.router_pid}): nothing answers on {state.endpoint_url}")
    checked = {m.member.name: m for m in check.members}
    return DeploymentStatus(
        record.name, record.scheduler, RunStatus.UNCONTROLLED, state.stage,
        f"controller pid {record.driver_pid} gone (see endpoint.log); {router}",
        record.run_dir, [{**rep, "healthy": rep["url"] in answering} for rep in state.replicas],
        state.error.to_dict() if state.error else None, record.job_id,
        stage_breakdown(read_timeline(record.run_dir), record.created, state.job_started), state.endpoint_url,
        [member_line(Member.from_json(m), checked.get(m["name"])) for m in state.members],
        [d.to_dict() for d in state.decisions],
        advice=f"nothing probes, replaces or scales it now: `hpcserve adopt {record.name}` brings control back "
               "(no running replica restarts)")


def member_line(member: Member, checked: MemberCheck | None = None) -> dict:
    """What status shows of a member: name, role, state, where it runs, its replicas. checked: its job and
    replicas as they are now (the controller that wrote its state is gone)."""
    record = member.as_record()
    line = {"name": member.name, "role": member.role, "status": member.status, "group": member.group,
            "runner": f"job {record.job_id}" if record.job_id else f"pid {record.driver_pid}",
            "backends": member.backends, "ready_s": member.ready_s, "note": member.note,
            "run_dir": record.run_dir, "error": member.error}
    if checked is not None:
        status = MemberStatus.GONE if checked.gone else member.status
        answer = f"{len(checked.answering)}/{len(member.backends)} replica(s) answer now" if member.backends else ""
        line.update(status=status, runner=checked.runner, note=answer if not checked.gone else "")
    return line


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


__all__ = ["up", "adopt", "down", "status", "log_files", "prepare", "api_key_for", "endpoints", "load_record",
           "HpcserveError", "Event", "UpResult", "DeploymentStatus", "RunStatus"]
