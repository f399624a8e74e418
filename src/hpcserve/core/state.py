"""Where hpcserve remembers deployments, and the files a deployment's run folder holds.

The registry (one small JSON file per deployment name) lives in $HPCSERVE_HOME, default
~/.local/state/hpcserve. Everything else about a deployment lives in its run folder
`<results_dir>/logs/<name>-<jobid>/`, written by the driver that runs it:

- state.json     what is running now: stage, status, replicas with their endpoints, the error if any
- timeline.json  one timestamp per stage
- api_key        the endpoint's key (mode 0600), when hpcserve generated it
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from hpcserve.core.errors import NotFoundError, UsageError

STATE_FILE = "state.json"
TIMELINE_FILE = "timeline.json"
API_KEY_FILE = "api_key"
API_KEY_SOURCE_FILE = "api_key_source"  # where clients find the key: the file above, $VARIABLE, or none


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
    kind: str = "driver"  # or "endpoint": the router and controller in front of member deployments


def registry_dir() -> Path:
    return home() / "deployments"


def save_record(record: Record) -> None:
    registry_dir().mkdir(parents=True, exist_ok=True)
    write_json(registry_dir() / f"{record.name}.json", asdict(record))


def load_record(name: str) -> Record:
    path = registry_dir() / f"{name}.json"
    if not path.is_file():
        known = ", ".join(list_names()) or "none"
        raise NotFoundError(f"no deployment named '{name}' (known: {known}). Start one with `hpcserve up CONFIG`.")
    data = json.loads(path.read_text())
    known = {f.name for f in fields(Record)}  # a record written by another hpcserve version still loads
    return Record(**{k: v for k, v in data.items() if k in known})


def list_names() -> list[str]:
    if not registry_dir().is_dir():
        return []
    return sorted(p.stem for p in registry_dir().glob("*.json"))


def forget(name: str) -> None:
    (registry_dir() / f"{name}.json").unlink(missing_ok=True)


def write_json(path: Path, data: Any) -> None:
    """Write atomically: readers (status, up's follower) never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return default


def read_api_key(run_dir: str | Path, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key clients send to the deployment of this run folder, found the way `up` stored it: the
    generated file (mode 0600), else the environment variable that api_key_source names ($NAME)."""
    path = Path(run_dir) / API_KEY_FILE
    if path.is_file():
        return path.read_text().strip()
    variable = key_variable(run_dir)
    if variable is None:
        return None
    if not environ.get(variable):
        raise UsageError(f"this deployment's API key is in ${variable} (serve.api_key_env), which is not set "
                         f"here: export {variable} as when you ran `hpcserve up`, or pass --api-key-env NAME")
    return environ[variable]


def key_variable(run_dir: str | Path) -> str | None:
    """The environment variable that holds the deployment's key, as `up` recorded it (api_key_source)."""
    try:
        source = (Path(run_dir) / API_KEY_SOURCE_FILE).read_text().strip()
    except OSError:
        return None
    return source[1:] if source.startswith("$") else None


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible endpoint: base URL without /v1, served model name, key (or None)."""

    base_url: str
    model: str | None
    api_key: str | None


def resolve_endpoint(target: str, api_key: str | None = None) -> list[Endpoint]:
    """A deployment name gives the endpoints of its replicas; a URL gives itself."""
    if target.startswith(("http://", "https://")):
        return [Endpoint(target.rstrip("/").removesuffix("/v1"), None, api_key)]
    record = load_record(target)
    state = read_json(Path(record.run_dir) / STATE_FILE, {}) or {}
    key = api_key or read_api_key(record.run_dir)
    replicas = state.get("replicas") or []
    endpoint = (state.get("endpoint") or {}).get("url")
    if endpoint and state.get("status") == "ready":  # one URL in front of every replica: the router
        return [Endpoint(endpoint, replicas[0].get("model") if replicas else None, key)]
    if not replicas:
        raise NotFoundError(f"deployment '{target}' has no endpoint yet (stage: {state.get('stage', 'unknown')}); "
                            f"see `hpcserve status {target}`")
    return [Endpoint(r["url"], r.get("model"), key) for r in replicas]
