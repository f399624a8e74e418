"""Ray token authentication, so other users of a shared cluster cannot submit work to our Ray.

The token lives in a file readable only by us (mode 0600) inside the run folder, on the shared
filesystem every node sees; processes find it through RAY_AUTH_TOKEN_PATH, so the token itself is
never in an environment listing, a script or a command line. RAY_AUTH_MODE is set explicitly on
every process: Ray 2.60 otherwise switches auth on for `ray start` when ~/.ray/auth_token exists
but not for every client, and joining hangs.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from hpcserve.core.files import create_secret

TOKEN_FILE = "ray_auth_token"


def create_token(run_dir: Path) -> Path:
    """A new token for this run's cluster. Never an existing file: a token already in the run folder was
    not made by this run (another user could have planted one they know), so it is an error."""
    return create_secret(Path(run_dir) / TOKEN_FILE, secrets.token_hex(32))


def auth_env(token_path: Path) -> dict[str, str]:
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
