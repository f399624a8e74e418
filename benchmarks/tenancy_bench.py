"""What the tenancy benchmarks (tenancy_overhead.py, tenancy_fair_share.py, tenancy_usage.py) share: a
temporary folder whose data planes and processes are stopped by their PIDs and which is removed at the end,
the deployment's key file, the data plane's tenancy settings, and the record of a run."""

from __future__ import annotations

import json
import platform
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from hpcserve.endpoint.control.plane_client import Router
from hpcserve.tenancy.records import Limits
from hpcserve.tenancy.settings import TenancySettings
from hpcserve.testing.harness import stop


@dataclass
class Workspace:
    folder: Path
    routers: list[Router] = field(default_factory=list)
    processes: list = field(default_factory=list)  # subprocess.Popen, each in a session of its own

    def key_file(self, key: str) -> Path:
        path = self.folder / "api_key"
        path.write_text(key)
        path.chmod(0o600)
        return path

    def tenancy(self, database: Path, flush_s: float = 1.0, limits: Limits = Limits(), pause: bool = True,
                name: str = "tenancy") -> Path:
        """The data plane's --tenancy file (NAME.json) for a store at `database`."""
        path = self.folder / f"{name}.json"
        path.write_text(json.dumps(TenancySettings(str(database), limits, flush_s, pause_streams=pause).to_json()))
        return path


@contextmanager
def workspace(prefix: str) -> Iterator[Workspace]:
    here = Workspace(Path(tempfile.mkdtemp(prefix=prefix)))
    try:
        yield here
    finally:
        for router in here.routers:
            router.stop()
            router.close()
        for process in here.processes:
            stop(process)
        shutil.rmtree(here.folder, ignore_errors=True)


def finish(results: dict, args) -> None:
    """The run's date, machine and arguments with its results; printed, and written to --json."""
    results["run"] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node(),
                      "cores": psutil.cpu_count(), "args": {k: str(v) if isinstance(v, Path) else v
                                                            for k, v in vars(args).items()}}
    print(json.dumps(results, default=dict))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=dict))
