"""The Debian packages the sandbox needs, installed on first use."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hpcserve.sandbox.procs import require_root, run

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "iproute2"]


def install_packages() -> None:
    """apt-get the Slurm and munge packages unless slurmctld is already there.

    No systemd in containers and CI: a temporary policy-rc.d (exit 101 = "deny") keeps the
    packages' postinst from starting the system-wide services; the sandbox starts its own.
    """
    if shutil.which("slurmctld"):
        return
    require_root()
    policy = Path("/usr/sbin/policy-rc.d")
    added_policy = not policy.exists()
    if added_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run(["apt-get", "update", "-qq"], timeout=300, env=env)
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
            timeout=900, env=env)
    finally:
        if added_policy:
            policy.unlink(missing_ok=True)
