"""A stand-in member: what a member's job runs instead of the driver (Ray and vLLM) in the scale tests,
so that a Slurm cluster of many nodes can carry an endpoint of many members on a 2-core machine.

    python -m hpcserve.testing.member RUN_DIR      (the job script execs it: Runs(driver_module=...))

It does what the controller reads of a driver: state.json (starting, then ready with its replica's
URL, stopped at the end) and timeline.json, and it serves a stand-in engine (testing.standin) on the
member's port, on every address of its node, with the endpoint's API key. SIGTERM (the controller's
orderly stop: scancel --signal=TERM --batch) ends it. The stand-in's speed comes from the deployment's
engine.env: STANDIN_DELAY_MS (per token) and STANDIN_SLOTS (requests at once, the rest queue); STANDIN_SLEEP=1
gives it vLLM's sleep routes (/sleep, /wake_up, /is_sleeping), as a GPU engine in sleep mode has.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import psutil
from aiohttp import web

from hpcserve.core.config import DeploymentConfig, load_config
from hpcserve.core.keys import read_api_key
from hpcserve.core.paths import RunPaths
from hpcserve.core.runstate import RunStateWriter
from hpcserve.core.statuses import RunStatus, Stage
from hpcserve.deployment.process import process_main, write_notice
from hpcserve.testing.standin import CONFIG, MetricsPage, make_app, run_loop

TOKEN_DELAY_ENV, SLOTS_ENV = "STANDIN_DELAY_MS", "STANDIN_SLOTS"
SLEEP_ENV = "STANDIN_SLEEP"  # "1": the stand-in has vLLM's sleep routes (as a GPU engine in sleep mode)


def own_address(bind_host: str) -> str:
    """The address others reach this member at: its node's (from the node's hosts file), or the bind
    address when that is a specific one."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    return socket.gethostbyname(socket.gethostname())


def standin_app(cfg: DeploymentConfig, api_key: str | None, model: str = "stub") -> web.Application:
    """Sleep routes as vLLM has them when started in sleep mode (engine.sleep_mode), or with STANDIN_SLEEP=1."""
    env = cfg.engine.env
    return make_app(cfg.name, token_delay_s=float(env.get(TOKEN_DELAY_ENV, 0)) / 1000, tokens=16,
                    api_key=api_key,
                    slots=int(env.get(SLOTS_ENV, 1_000_000)), metrics=MetricsPage.load(),
                    sleep_mode=env.get(SLEEP_ENV) == "1" or cfg.engine_sleeps, model=model)


async def start_engine(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return runner


async def start_swap_engines(cfg: DeploymentConfig, api_key: str | None) -> tuple[list[web.AppRunner], list[dict]]:
    """The swap models' engines, each started and put to sleep before the next (as vLLM on shared GPUs must:
    each profiles the memory free at its start), before the member's own model: that one ends awake."""
    runners, engines = [], []
    for spec, port in zip(cfg.swap.models if cfg.swap else [], cfg.swap_ports()):
        app = standin_app(cfg, api_key, spec.name)
        runners.append(await start_engine(app, cfg.serve.host, port))
        app[CONFIG]["asleep"] = True  # what POST /sleep does
        engines.append({"model": spec.name, "url": f"http://{own_address(cfg.serve.host)}:{port}"})
    return runners, engines


async def serve(cfg: DeploymentConfig, writer: RunStateWriter, api_key: str | None) -> None:
    swap_runners, swap_engines = await start_swap_engines(cfg, api_key)
    runner = await start_engine(standin_app(cfg, api_key), cfg.serve.host, cfg.serve.port)
    url = f"http://{own_address(cfg.serve.host)}:{cfg.serve.port}"
    writer.update(swap=swap_engines)
    writer.done(Stage.ENGINE, url)
    writer.begin(Stage.READY)
    writer.update(status=RunStatus.READY, replicas=[{"index": 0, "url": url, "model": cfg.model.name,
                                                     "healthy": True, "nodes": [socket.gethostname()]}])
    stopped = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopped.set)
    # Slurm's --signal (preempted, or the time limit near): told to the controller, serving on
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, write_notice, writer.run_dir, signal.SIGUSR1)
    await stopped.wait()
    writer.update(status=RunStatus.STOPPING, stop_reason="SIGTERM")
    for each in (runner, *swap_runners):
        await each.cleanup()


def run(run_dir: Path) -> int:
    cfg = load_config(RunPaths(run_dir).config)
    writer = RunStateWriter(run_dir)
    writer.update(driver_pid=os.getpid(), driver_host=socket.gethostname(), status=RunStatus.STARTING,
                  job_started=psutil.Process().create_time())
    writer.begin(Stage.ENGINE, "a stand-in engine (hpcserve.testing.member)")
    try:
        run_loop(serve(cfg, writer, read_api_key(run_dir)))  # the run folder's 0600 copy, as the driver reads it
    finally:
        writer.update(status=RunStatus.STOPPED, stopped=time.time())
        writer.done(Stage.STOPPED)
    return 0


if __name__ == "__main__":
    process_main(run, "hpcserve.testing.member")
