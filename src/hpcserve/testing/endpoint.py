"""The real endpoint process (endpoint.control.process.run: router, Controller, teardown) over stand-in members:

    HPCSERVE_STANDIN_FARM=http://127.0.0.1:A  python -m hpcserve.testing.endpoint RUN_DIR
        members are stand-ins of a farm on this machine (testing.members.StandinRuns)
    HPCSERVE_STANDIN_MEMBER=1                 python -m hpcserve.testing.endpoint RUN_DIR
        members are real Slurm jobs (or local processes) that run hpcserve.testing.member instead of
        the driver (Ray and vLLM): a stand-in engine on the member's port

Only the member launcher differs from `hpcserve up`'s endpoint; the scale benchmarks start it with
deployment.runs.LocalRun.start(cfg, results, "hpcserve.testing.endpoint", RunKind.ENDPOINT, env).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hpcserve.deployment.process import process_main
from hpcserve.deployment.runs import Launcher, Runs
from hpcserve.endpoint.control import process
from hpcserve.endpoint.control.controller import JOB_CHECK_EVERY_S
from hpcserve.testing.members import StandinRuns

FARM_ENV = "HPCSERVE_STANDIN_FARM"
MEMBER_ENV = "HPCSERVE_STANDIN_MEMBER"
READY_AFTER_ENV = "HPCSERVE_STANDIN_READY_AFTER_S"
MEMBER_MODULE = "hpcserve.testing.member"


def launcher() -> Launcher:
    if os.environ.get(FARM_ENV):
        return StandinRuns(os.environ[FARM_ENV], ready_after_s=float(os.environ.get(READY_AFTER_ENV) or 0))
    if os.environ.get(MEMBER_ENV):
        return Runs.default(JOB_CHECK_EVERY_S, driver_module=MEMBER_MODULE)
    sys.exit(f"set {FARM_ENV} (a stand-in farm's admin URL) or {MEMBER_ENV}=1 (stand-in member jobs)")


def run(run_dir: Path) -> int:
    return process.run(run_dir, launcher())


if __name__ == "__main__":
    process_main(run, "hpcserve.testing.endpoint")
