"""The endpoint's API key: where `up` put it, and finding it again."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from hpcserve.core.errors import UsageError
from hpcserve.core.files import write_secret, write_text
from hpcserve.core.paths import RunPaths


def new_key() -> str:
    return secrets.token_urlsafe(32)


def bearer(api_key: str | None) -> dict[str, str]:
    """The Authorization header of a request with this key (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def store_key(run_dir: Path, variable: str | None, generated: str | None) -> None:
    """A generated key goes into a file only we can read; api_key_source says where clients find it."""
    paths = RunPaths(run_dir)
    if generated:
        write_secret(paths.api_key, generated)
        source = str(paths.api_key)
    else:
        source = f"${variable}" if variable else "none"
    write_text(paths.api_key_source, source + "\n")


def read_api_key(run_dir: str | Path, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key clients send to the deployment of this run folder, found the way `up` stored it: the
    generated file (mode 0600), else the environment variable that api_key_source names ($NAME)."""
    path = RunPaths(Path(run_dir)).api_key
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
        source = RunPaths(Path(run_dir)).api_key_source.read_text().strip()
    except OSError:
        return None
    return source[1:] if source.startswith("$") else None


def key_source(run_dir: str | Path) -> str | None:
    """What `up` tells users about the key: the file, $VARIABLE, or none."""
    path = RunPaths(Path(run_dir)).api_key_source
    return path.read_text().strip() if path.exists() else None
