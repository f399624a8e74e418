"""The Debian packages the sandbox needs, installed on first use."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from hpcserve.sandbox.procs import require_root, run

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "iproute2"]

# Several callers may build sandboxes at once (two pytest workers, two shells): apt refuses a second
# apt-get while one holds its lists lock, so the installers queue here and the later ones find it done.
INSTALL_LOCK = Path("/run/lock/hpcserve-sandbox-packages.lock")
APT_LOCK_WAIT_S = 300  # apt-get waits this long for a dpkg lock held by someone else (another apt run)


def packages_missing() -> bool:
    return shutil.which("slurmctld") is None


def install_packages() -> None:
    """apt-get the Slurm and munge packages unless slurmctld is already there.

    No systemd in containers and CI: a temporary policy-rc.d (exit 101 = "deny") keeps the
    packages' postinst from starting the system-wide services; the sandbox starts its own.
    """
    if not packages_missing():
        return
    require_root()
    INSTALL_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(INSTALL_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if packages_missing():  # the caller that held the lock before us may have installed them
            _apt_install(PACKAGES)


def _apt_install(packages: list[str]) -> None:
    policy = Path("/usr/sbin/policy-rc.d")
    added_policy = not policy.exists()
    if added_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        wait = f"DPkg::Lock::Timeout={APT_LOCK_WAIT_S}"
        run(["apt-get", "-o", wait, "update", "-qq"], timeout=APT_LOCK_WAIT_S + 300, env=env)
        run(["apt-get", "-o", wait, "install", "-y", "-qq", "--no-install-recommends", *packages],
            timeout=APT_LOCK_WAIT_S + 900, env=env)
    finally:
        if added_policy:
            policy.unlink(missing_ok=True)
