"""The Debian packages the sandbox needs, installed on first use."""

from __future__ import annotations

import shutil
from pathlib import Path

from hpcserve.core.apt import install_once
from hpcserve.sandbox.procs import require_root

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "iproute2"]

# Several callers may build sandboxes at once (two pytest workers, two shells): they queue here (core.apt).
INSTALL_LOCK = Path("/run/lock/hpcserve-sandbox-packages.lock")


def packages_missing() -> bool:
    return shutil.which("slurmctld") is None


def install_packages() -> None:
    """apt-get the Slurm and munge packages unless slurmctld is already there (the sandbox starts its own
    daemons: core.apt keeps the packages from starting the system-wide services)."""
    if not packages_missing():
        return
    require_root()
    install_once(PACKAGES, packages_missing, INSTALL_LOCK)
