"""The endpoint's API key: chosen at `up`, handed to every process that needs it through 0600 files in
the run folders (never a command line, a script or a job's environment), found again by clients, and
removed with the deployment.

Every deployment has a key: the value of serve.api_key_env when that variable is set, else a generated
one. The only exception is the loudly named serve.insecure_no_api_key, for a laptop.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcserve.core.errors import UnsafePathError, UsageError
from hpcserve.core.files import create_secret, read_secret, remove_files, write_text
from hpcserve.core.paths import RunPaths

GENERATED = "generated"
NO_KEY = "none"


def new_key() -> str:
    return secrets.token_urlsafe(32)


def bearer(api_key: str | None) -> dict[str, str]:
    """The Authorization header of a request with this key (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class KeyCheck:
    """The one check of a client's `Authorization: Bearer KEY` header, for the data plane, the engines'
    guard and the monitor alike: the scheme in any case (RFC 9110 11.1), the token trimmed, and both
    sides hashed before a constant-time comparison, so that neither the key's content nor its length
    leaks through the time a wrong guess takes. No key: everything passes (an open endpoint). Pure."""

    __slots__ = ("digest",)

    def __init__(self, key: str | None):
        self.digest = hashlib.sha256(key.encode()).digest() if key else None

    def allows(self, authorization: str | bytes | None) -> bool:
        if self.digest is None:
            return True
        token = bearer_token(authorization)
        return token is not None and hmac.compare_digest(hashlib.sha256(token).digest(), self.digest)


def bearer_token(authorization: str | bytes | None) -> bytes | None:
    """The token of an Authorization header's value when its scheme is Bearer (any case), else None. Pure."""
    if authorization is None:
        return None
    if isinstance(authorization, str):
        authorization = authorization.encode("utf-8", "surrogateescape")
    scheme, _, token = authorization.strip().partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


def read_key_file(path: Path) -> str:
    """A key from a file that is ours alone (the data plane's, never a command line). Raises ValueError
    with the reason and the fix."""
    try:
        key = read_secret(path)
    except UnsafePathError as exc:
        raise ValueError(str(exc)) from None
    if not key:
        raise ValueError(f"{path} is empty")
    return key


@dataclass(frozen=True)
class ApiKey:
    """A deployment's key and where its user finds it: "$NAME" (their variable), "generated" (the run
    folder's api_key file), "none" (insecure_no_api_key), or the source line of the endpoint a member
    serves (members get a copy of their endpoint's key)."""

    value: str | None
    source: str


def choose_key(variable: str | None, insecure_no_key: bool, environ: Mapping[str, str] = os.environ) -> ApiKey:
    """The key a new deployment is guarded with: the variable's value when it is set, else a new one."""
    if insecure_no_key:
        return ApiKey(None, NO_KEY)
    if variable and environ.get(variable):
        return ApiKey(environ[variable], f"${variable}")
    return ApiKey(new_key(), GENERATED)


def store_key(run_dir: Path, key: ApiKey) -> None:
    """The key into a new 0600 file of the run folder (what the run's processes read), and api_key_source:
    where clients find it (the file for a generated key, else the variable)."""
    paths = RunPaths(run_dir)
    if key.value:
        create_secret(paths.api_key, key.value)
    source = str(paths.api_key) if key.source == GENERATED else key.source
    write_text(paths.api_key_source, source + "\n")


def handed_on(run_dir: str | Path, value: str | None) -> ApiKey:
    """The key of this run as it is handed to a run it starts (an endpoint's member)."""
    return ApiKey(value, key_source(run_dir) or NO_KEY)


def read_api_key(run_dir: str | Path, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key clients send to the deployment of this run folder: its api_key file (ours alone, mode
    0600), else the environment variable that api_key_source names ($NAME)."""
    path = RunPaths(Path(run_dir)).api_key
    if os.path.lexists(path):
        return read_secret(path)
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


def secret_files(run_dir: str | Path) -> list[Path]:
    """Every secret hpcserve writes into a run folder and its members' (keys, the router's, Ray's token)."""
    paths = RunPaths(Path(run_dir))
    folders = [paths, *(RunPaths(p) for p in paths.member_run_dirs())]
    return [f for p in folders for f in (p.api_key, p.router_key, p.ray_token)]


def remove_secrets(run_dir: str | Path) -> list[Path]:
    """A stopped deployment keeps no key: its copies in the run folders are removed (the user's own
    variable, if the key came from one, is theirs). Returns the files that were there."""
    return remove_files(secret_files(run_dir))
