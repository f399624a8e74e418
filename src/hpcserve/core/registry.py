"""Where hpcserve remembers deployments by name: one small JSON file each in $HPCSERVE_HOME (default
~/.local/state/hpcserve). Everything else about a deployment lives in its run folder (core.paths)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from hpcserve.core.errors import NotFoundError
from hpcserve.core.files import write_json
from hpcserve.core.folders import check_not_shared, private_dir
from hpcserve.core.statuses import RunKind


def home() -> Path:
    return Path(os.environ.get("HPCSERVE_HOME") or Path.home() / ".local" / "state" / "hpcserve")


@dataclass
class Record:
    """What `up` registers so that `status`, `logs` and `down` find the deployment by name."""

    name: str
    scheduler: str
    run_dir: str
    job_id: str | None = None
    driver_pid: int | None = None
    driver_started: float | None = None  # create time, so a reused PID is never mistaken for ours
    config_path: str | None = None
    created: float = field(default_factory=time.time)
    kind: RunKind = RunKind.DRIVER
    host: str | None = None  # where its process runs (a LocalRun): its PID means something only there

    def __post_init__(self) -> None:
        self.kind = RunKind(self.kind)

    @classmethod
    def from_dict(cls, data: dict) -> Record:
        known = {f.name for f in fields(cls)}  # a record written by another hpcserve version still loads
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)


HOME_FIX = ("Set HPCSERVE_HOME to a folder only you can write (the default is ~/.local/state/hpcserve), or "
            "remove the others' write permission (chmod go-w FOLDER)")


def check_home() -> Path:
    """The registry's folder, refused when others can write into it: a record names the run folder whose
    files hpcserve trusts and the PIDs `down` stops."""
    check_not_shared(home(), "HPCSERVE_HOME", HOME_FIX)
    return home()


def registry_dir() -> Path:
    return check_home() / "deployments"


def save_record(record: Record) -> None:
    private_dir(registry_dir())
    write_json(registry_dir() / f"{record.name}.json", record.to_dict())


def load_record(name: str) -> Record:
    path = registry_dir() / f"{name}.json"
    if not path.is_file():
        known = ", ".join(list_names()) or "none"
        raise NotFoundError(f"no deployment named '{name}' (known: {known}). Start one with `hpcserve up CONFIG`.")
    return Record.from_dict(json.loads(path.read_text()))


def list_names() -> list[str]:
    if not registry_dir().is_dir():
        return []
    return sorted(p.stem for p in registry_dir().glob("*.json"))


def forget(name: str) -> None:
    (registry_dir() / f"{name}.json").unlink(missing_ok=True)
