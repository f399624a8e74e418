"""Debian packages installed on first use (the Slurm sandbox's, the tests' PostgreSQL), one installer at a time.

Several callers may need them at once (two pytest workers, two shells): apt refuses a second apt-get while one
holds its lists lock, so the installers queue on a lock file of ours and the later ones find the work done.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from hpcserve.core.errors import CommandError

APT_LOCK_WAIT_S = 300  # apt-get waits this long for a dpkg lock held by someone else (another apt run)
POLICY_RC = Path("/usr/sbin/policy-rc.d")


def install_once(packages: Sequence[str], missing: Callable[[], bool], lock: Path) -> None:
    """apt-get `packages` unless missing() says they are there, checked again under `lock` (a caller that
    held it before us may have installed them). The caller checks that it runs as root."""
    if not missing():
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if missing():
            apt_install(packages)


def apt_install(packages: Sequence[str]) -> None:
    """apt-get install without recommends, the package lists updated first.

    No systemd in containers and CI: a temporary policy-rc.d (exit 101 = "deny") keeps the packages'
    postinst from starting their system-wide services; whoever needs them starts their own.
    """
    added_policy = not POLICY_RC.exists()
    if added_policy:
        POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        wait = f"DPkg::Lock::Timeout={APT_LOCK_WAIT_S}"
        _run(["apt-get", "-o", wait, "update", "-qq"], timeout=APT_LOCK_WAIT_S + 300, env=env)
        _run(["apt-get", "-o", wait, "install", "-y", "-qq", "--no-install-recommends", *packages],
             timeout=APT_LOCK_WAIT_S + 900, env=env)
    finally:
        if added_policy:
            POLICY_RC.unlink(missing_ok=True)


def _run(argv: list[str], *, timeout: float, env: dict[str, str]) -> None:
    """Run argv; CommandError quoting its output (stdout and stderr together) when it fails or times out."""
    try:
        done = subprocess.run(argv, check=False, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        raise CommandError(argv, None, out or "") from None
    except FileNotFoundError:
        raise CommandError(argv, 127, f"{argv[0]}: command not found") from None
    if done.returncode != 0:
        raise CommandError(argv, done.returncode, done.stdout)
