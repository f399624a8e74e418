"""The endpoint: `python -m hpcserve.endpoint.process RUN_DIR`, one per deployment with serve.router on.

It runs where `hpcserve up` ran (the login node, or this machine in local mode) and outlives every job:

    router    one OpenAI endpoint on serve.port, the API key enforced there (endpoint/router.py)
    members   deployments that serve the replicas (endpoint/members.py): Slurm jobs, or local drivers
    control   every second (endpoint/controller.py): probes, replacements, autoscale, walltime handover

SIGTERM drains nothing: it stops the members and the router, and nothing stays running.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from hpcserve.core.config import DeploymentConfig, Layout, load_config
from hpcserve.deployment.driver import Stop
from hpcserve.deployment.runs import stop
from hpcserve.endpoint.controller import TICK_S, Endpoint, MemberFailed
from hpcserve.endpoint.members import Member, group_layouts
from hpcserve.engine.client import READY_PROMPT, completion_probe
from hpcserve.core.state import read_api_key


# ---------------------------------------------------------------- the process

def serve(endpoint: Endpoint) -> None:
    """Launch the configured replicas, open the router once the first member serves, then control."""
    cfg, progress = endpoint.cfg, endpoint.progress
    layout = cfg.parallelism if isinstance(cfg.parallelism, Layout) else resolved_layout(cfg)
    # One member (job) per replica: a lost node or a job's end takes one replica, not the endpoint.
    initial = [endpoint.launch("initial", shape, group=group) for group, shape in group_layouts(cfg, layout)]
    while not all(m.status == "serving" for m in initial):  # a member failing first fails `up` (MemberFailed)
        endpoint.tick()
        time.sleep(TICK_S / 2)
    progress.begin("router", f"endpoint {endpoint.router.url}")
    answer = completion_probe(endpoint.router.url, cfg.model.name, endpoint.api_key, timeout_s=60)
    progress.done("router")
    endpoint.ready = True
    progress.begin("ready")
    progress.update(status="ready", ready_check={"prompt": READY_PROMPT, "answers": {"endpoint": answer}})
    while True:
        endpoint.tick()
        endpoint.rotate_until(time.monotonic() + TICK_S)


def resolved_layout(cfg: DeploymentConfig) -> Layout:
    from hpcserve.deployment.driver import resolve_layout
    from hpcserve.deployment.preflight import model_config_for, resolve_model_path

    return resolve_layout(cfg, model_config_for(cfg, resolve_model_path(cfg)))


def teardown(endpoint: Endpoint) -> None:
    """Every member stopped (in parallel: each job takes seconds), then the router."""
    def stop_one(member: Member) -> None:
        try:
            stop(member.as_record(), timeout_s=60)
        except Exception:  # noqa: BLE001 - keep stopping the others
            traceback.print_exc()

    threads = [threading.Thread(target=stop_one, args=(m,)) for m in endpoint.members if m.status != "gone"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for member in endpoint.members:
        member.status = "gone"
    endpoint.router.stop()


def run(run_dir: Path) -> int:
    from hpcserve.endpoint.router import Router

    cfg = load_config(run_dir / "config.yaml")
    api_key = os.environ.get(cfg.serve.api_key_env or "", "") or read_api_key(run_dir)
    router = Router(cfg.serve.host, cfg.serve.port, key_file(run_dir, api_key), run_dir / "router.log",
                    model=cfg.model.name)
    endpoint = Endpoint(cfg, run_dir, router, api_key)
    progress = endpoint.progress  # the one writer of state.json and timeline.json
    progress.update(driver_pid=os.getpid(), status="starting", job_started=time.time())
    try:
        signal.signal(signal.SIGTERM, endpoint.request_stop)
        signal.signal(signal.SIGINT, endpoint.request_stop)
        router.start([])
        serve(endpoint)
        return 0
    except Stop as why:
        progress.update(status="stopping", stop_reason=str(why))
        return 0
    except MemberFailed as failed:
        progress.fail(failed.error.get("stage") or "engine", failed.error.get("diagnosis") or "failed",
                      failed.error.get("log"))
        return 1
    except Exception as exc:  # noqa: BLE001 - reported by stage, like the driver does
        traceback.print_exc()
        progress.fail(progress.state.get("stage", "router"), f"{type(exc).__name__}: {exc}",
                      str(run_dir / "endpoint.log"))
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        teardown(endpoint)
        endpoint.save()
        if progress.state.get("status") != "failed":
            progress.update(status="stopped")
        progress.done("stopped")


def key_file(run_dir: Path, api_key: str | None) -> Path | None:
    """The router reads the key from a file only we can read (never its command line)."""
    if not api_key:
        return None
    path = run_dir / ".router_key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(api_key)
    return path


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m hpcserve.endpoint.process RUN_DIR")
    sys.exit(run(Path(sys.argv[1]).resolve()))


if __name__ == "__main__":
    main()
