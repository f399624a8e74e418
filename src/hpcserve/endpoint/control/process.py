"""The endpoint: `python -m hpcserve.endpoint.control.process RUN_DIR`, one per deployment with serve.router on.

It runs where `hpcserve up` ran (the login node, or this machine in local mode) and outlives every job:

    router    one OpenAI endpoint on serve.port, the API key enforced there: the data plane process
              (endpoint/dataplane/), driven over its admin socket (endpoint/control/plane_client.py)
    members   deployments that serve the replicas (endpoint/control/members.py): Slurm jobs, or local drivers
    control   every second (endpoint/control/controller.py): probes, replacements, autoscale, walltime handover

SIGTERM drains nothing: it stops the members and the router, and nothing stays running.

Started in a run folder whose state.json lists members, it adopts them instead (its predecessor was lost
with the login node or killed): control/resume.py. A run folder with members is never started afresh,
so no second set of jobs can appear beside the running ones. An adoption that fails leaves what ran as
it was (the data plane kept serving without a controller; it does so still).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from hpcserve.core.config import DeploymentConfig, Layout, load_config
from hpcserve.core.files import remove_files, write_secret, write_text
from hpcserve.core.keys import read_api_key
from hpcserve.core.paths import RunPaths
from hpcserve.core.runstate import RunState
from hpcserve.core.statuses import MemberRole, MemberStatus, RunStatus, Stage
from hpcserve.deployment.process import install_stop_handlers, process_main, run_to_end
from hpcserve.deployment.runs import Launcher
from hpcserve.endpoint.control.controller import MEMBER_STOP_TIMEOUT_S, TICK_S, Controller
from hpcserve.endpoint.control.joining import joined_router
from hpcserve.endpoint.control.members import Member, group_layouts
from hpcserve.endpoint.control.plane_client import Host, Router, default_workers
from hpcserve.endpoint.control.resume import resume
from hpcserve.endpoint.protocol import ModelSpec
from hpcserve.engine.args import routes_by_cache
from hpcserve.engine.client import READY_PROMPT, completion_probe
from hpcserve.engine.kv_events import flag_value
from hpcserve.planning.model_source import resolve_model_path, resolved_layout
from hpcserve.slurm.client import SlurmClient
from hpcserve.tenancy.selfservice import SelfServiceServer
from hpcserve.tenancy.settings import TenancySettings, tenancy_on
from hpcserve.tenancy.store import open_store

log = logging.getLogger(__name__)


def serve(ctl: Controller) -> None:
    """Launch the configured replicas, open the router once the first member serves, then control."""
    cfg, writer = ctl.cfg, ctl.writer
    layout = cfg.parallelism if isinstance(cfg.parallelism, Layout) else resolved_layout(cfg)
    # One member (job) per replica: a lost node or a job's end takes one replica, not the endpoint.
    initial = [ctl.launch(MemberRole.INITIAL, shape, group=group) for group, shape in group_layouts(cfg, layout)]
    while not all(m.status is MemberStatus.SERVING for m in initial):  # a member failing first fails `up`
        ctl.tick()
        time.sleep(TICK_S / 2)
    writer.begin(Stage.ROUTER, f"endpoint {ctl.router.url}")
    answer = completion_probe(ctl.router.url, cfg.model.name, ctl.api_key, timeout_s=60)
    writer.done(Stage.ROUTER)
    ctl.ready = True
    writer.begin(Stage.READY)
    writer.update(status=RunStatus.READY, ready_check={"prompt": READY_PROMPT, "answers": {"endpoint": answer}})
    control(ctl)


def adopt_and_control(ctl: Controller, previous: RunState, adopted: threading.Event) -> None:
    """Take over what the lost controller left running, then control it as if it had been ours."""
    ctl.writer.begin(Stage.ADOPT, f"controller pid {os.getpid()} takes over {len(previous.members)} member(s) "
                                  "and the router")
    summary = resume(ctl, previous)
    ctl.ready = True
    adopted.set()
    ctl.writer.done(Stage.ADOPT, summary)
    ctl.writer.begin(Stage.READY)
    ctl.writer.update(status=RunStatus.READY)
    ctl.save()
    control(ctl)


def leave_running(ctl: Controller) -> None:
    """An adoption that failed (or was stopped) leaves what ran running; state.json gets what changed but
    keeps the router PID it had unless this controller started a new router."""
    if ctl.router.pid is not None:
        ctl.save()
    elif ctl.members:
        with ctl.lock:
            ctl.writer.update(members=[m.to_json() for m in ctl.members],
                              decisions=[d.to_dict() for d in ctl.decisions[-20:]])


def control(ctl: Controller) -> None:
    while True:
        ctl.tick()
        ctl.rotate_until(time.monotonic() + TICK_S)


def teardown(ctl: Controller) -> None:
    """Every member stopped (in parallel: each job takes seconds), then the router."""
    def stop_one(member: Member) -> None:
        try:
            ctl.runs.run_of(member.as_record()).stop(timeout_s=MEMBER_STOP_TIMEOUT_S)
        except Exception:  # keep stopping the others
            log.exception("stopping member %s failed", member.name)

    threads = [threading.Thread(target=stop_one, args=(m,)) for m in ctl.members if m.status is not MemberStatus.GONE]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=2 * MEMBER_STOP_TIMEOUT_S)
    with ctl.lock:
        for member in ctl.members:
            member.status = MemberStatus.GONE
    ctl.router.stop()
    remove_files([RunPaths(ctl.run_dir).router_key])  # the router's copy of the key: no router, no copy
    ctl.close()
    ctl.save()


def dataplane_options(cfg) -> list[str]:
    """The data plane's flags from the config: its migrations, its admission share, and --tokenizer (with the
    engines' --chat-template), so that it reads prompts as the engines' token ids and routes by their KV events;
    no tokenizer where the model folder is not readable here (a hub id, or weights only on the compute
    nodes: it routes by the prompts' text then)."""
    return ["--migrations", str(cfg.serve.migrations), "--admit-kv-share", f"{cfg.serve.admit_kv_share:g}",
            *tokenizer_options(cfg)]


def tenancy_options(cfg, paths: RunPaths) -> list[str]:
    """--tenancy FILE: users' keys, limits and the usage record (its database beside the run folders unless the
    config names one); none for an open endpoint."""
    if not tenancy_on(cfg):
        return []
    settings = TenancySettings.from_config(cfg, paths.root.parent.parent)  # RESULTS/logs/RUN
    write_text(paths.tenancy, json.dumps(settings.to_json()), mode=0o600)  # again when a controller adopts
    return ["--tenancy", str(paths.tenancy)]


def tokenizer_options(cfg) -> list[str]:
    folder, template = tokenizer_source(cfg)
    if folder is None:
        return []
    return ["--tokenizer", folder] + (["--chat-template", template] if template else [])


def tokenizer_source(cfg) -> tuple[str | None, str | None]:
    """The model folder whose tokenizer.json the data plane reads prompts with, and the engines' chat
    template; (None, None) where it routes by the prompts' text."""
    if not (cfg.serve.router and routes_by_cache(cfg)):
        return None, None
    folder = Path(resolve_model_path(cfg))
    if not (folder / "tokenizer.json").is_file():
        return None, None
    return str(folder), flag_value(list(cfg.engine.args), "--chat-template")


def swap_rooms(cfg: DeploymentConfig, router: Router, paths: RunPaths) -> dict[str, Router]:
    """Each swap model's room in this endpoint's data plane (made by policies.swapping once it runs), driven
    as a joined model's: scoped to its model, over the same admin socket."""
    rooms = {}
    for spec in cfg.swap.models if cfg.swap else []:
        model_cfg = cfg.model_copy(update={"model": spec})
        folder, template = tokenizer_source(model_cfg)
        room = ModelSpec(spec.name, str(cfg.serve.routing), cfg.serve.hold_s, folder, template)
        rooms[spec.name] = Router(cfg.serve.host, cfg.serve.port, router.api_key_file, paths.router_log,
                                  model=spec.name, policy=cfg.serve.routing, admin_socket=router.admin_socket,
                                  hold_s=cfg.serve.hold_s, joined=Host(room, lambda: router.pid))
    return rooms


def run(run_dir: Path, runs: Launcher | None = None) -> int:
    """runs: how members start (default: real deployments); a benchmark may run stand-in members."""
    paths = RunPaths(run_dir)
    cfg = load_config(paths.config)
    previous = RunState.read(run_dir)
    adopting = bool(previous.members)
    api_key = read_api_key(run_dir)  # the run folder's copy, written by `up` before this process started
    key_file = write_secret(paths.router_key, api_key) if api_key else None  # never on a command line
    if cfg.serve.join:  # our model's room in another endpoint's data plane: its port, key and tenants
        router = joined_router(cfg, paths, key_file, tokenizer_source(cfg))
    else:
        options = dataplane_options(cfg) + tenancy_options(cfg, paths)
        router = Router(cfg.serve.host, cfg.serve.port, key_file, paths.router_log, model=cfg.model.name,
                        admin_socket=paths.router_admin, hold_s=cfg.serve.hold_s, options=options,
                        policy=cfg.serve.routing, workers=cfg.serve.router_workers or default_workers())
    ctl = Controller(cfg, run_dir, router, api_key, runs, swap_rooms(cfg, router, paths))
    keys_desk = None if cfg.serve.join else self_service(cfg, paths, router.url)
    started = {} if adopting else {"job_started": time.time()}  # where up's time went stays up's
    ctl.writer.update(driver_pid=os.getpid(), status=RunStatus.STARTING, **started)
    install_stop_handlers(ctl.request_stop)
    if adopting:
        adopted = threading.Event()
        def adopt_body() -> None:
            open_desk(keys_desk)
            adopt_and_control(ctl, previous, adopted)

        def adopt_end() -> None:  # what ran stays running unless the adoption got as far as controlling it
            close_desk(keys_desk)
            if adopted.is_set():
                teardown(ctl)
            else:
                leave_running(ctl)

        return run_to_end(ctl.writer, adopt_body, adopt_end, paths.endpoint_log, Stage.ADOPT)

    def body() -> None:
        router.start([])
        open_desk(keys_desk)
        serve(ctl)

    def end() -> None:
        close_desk(keys_desk)
        teardown(ctl)

    return run_to_end(ctl.writer, body, end, paths.endpoint_log, Stage.ROUTER)


def self_service(cfg, paths: RunPaths, url: str) -> SelfServiceServer | None:
    """The socket where users of this host get keys of their own (tenancy.self_service.allow), else None."""
    if not (tenancy_on(cfg) and cfg.tenancy.self_service.allow):
        return None
    settings = TenancySettings.read(paths.tenancy)
    accounts = SlurmClient().default_account if cfg.tenancy.self_service.project_from_slurm else None
    return SelfServiceServer(lambda: open_store(settings.database), cfg.tenancy.self_service, cfg.name,
                             settings.limits, accounts, url=url)


def open_desk(desk: SelfServiceServer | None) -> None:
    if desk is not None:
        log.info("self-service keys at %s", desk.start())


def close_desk(desk: SelfServiceServer | None) -> None:
    if desk is not None:
        desk.close()


if __name__ == "__main__":
    process_main(run, "hpcserve.endpoint.control.process")
