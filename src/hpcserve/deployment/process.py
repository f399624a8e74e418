"""The skeleton every long-running hpcserve process shares (the driver, the endpoint controller):
`python -m MODULE RUN_DIR`, signals that end it in order, every failure reported by stage into the run
folder (never a bare traceback), and what it started torn down whatever happened."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hpcserve.core.errors import HpcserveError, StageError
from hpcserve.core.files import write_json
from hpcserve.core.logs import configure_process_logging
from hpcserve.core.osenv import PRIVATE_UMASK
from hpcserve.core.paths import RunPaths
from hpcserve.core.runstate import RunStateWriter
from hpcserve.core.statuses import RunStatus, Stage

log = logging.getLogger(__name__)


class Stop(Exception):
    """SIGTERM/SIGINT arrived: wind down."""


def raise_stop(signum, _frame) -> None:
    raise Stop(signal.Signals(signum).name)


def install_stop_handlers(handler=raise_stop) -> None:
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def write_notice(run_dir: Path, signum: int) -> None:
    """The signal Slurm sent the job (its --signal=B:USR1: preempted, or its time limit near), for the
    controller (RunPaths.notice), which drains the member at once. Written whole."""
    write_json(RunPaths(run_dir).notice, {"signal": signal.Signals(signum).name, "time": time.time()})


def install_notice_handler(run_dir: Path) -> None:
    """SIGUSR1 (the member's --signal) is written down, not a stop: the member serves on while it is
    drained, and Slurm ends the job at the end of its grace time."""
    signal.signal(signal.SIGUSR1, lambda signum, _frame: write_notice(run_dir, signum))


def run_to_end(writer: RunStateWriter, body: Callable[[], None], teardown: Callable[[], None],
               own_log: Path, first_stage: str) -> int:
    """Run body; report how it ended into state.json; always tear down. Returns the exit code."""
    try:
        body()
        return 0
    except Stop as why:
        writer.update(status=RunStatus.STOPPING, stop_reason=str(why))
        return 0
    except StageError as exc:
        writer.fail(exc.stage, exc.diagnosis, exc.log)
        return 1
    except HpcserveError as exc:
        writer.fail(writer.state.get("stage", first_stage), str(exc), str(own_log))
        return 1
    except Exception as exc:  # any other failure is still reported by stage
        log.exception("%s: %s", type(exc).__name__, exc)  # noqa: TRY401 - the failure on the record's first line
        writer.fail(writer.state.get("stage", first_stage), f"{type(exc).__name__}: {exc}", str(own_log))
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish tearing down even if signalled again
        try:
            teardown()
        finally:
            if writer.status not in (RunStatus.FAILED, RunStatus.CHECKED):
                writer.update(status=RunStatus.STOPPED)
            writer.done(Stage.STOPPED)


def process_main(run: Callable[[Path], int], module: str) -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m {module} RUN_DIR")
    os.umask(PRIVATE_UMASK)  # what it and its children (Ray, engines, the router) write is for us alone
    configure_process_logging()  # stderr: the run folder's log file (deployment.runs, the batch script)
    sys.exit(run(Path(sys.argv[1]).resolve()))
