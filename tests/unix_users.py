"""Real Unix users for the tests of who-is-who (self-service keys): two of them, made idempotently and kept
(another pytest process or xdist worker may be using them at the same moment), and a Python they can run
with hpcserve importable."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ALICE, BOB = "hpcs-alice", "hpcs-bob"
TEST_USER_COMMENT = "hpcserve self-service test user"
VENV_SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def ensure_user(name: str) -> None:
    """Make a test user unless it exists; a user of that name that is not ours is never touched."""
    for _ in range(20):
        try:
            entry = pwd.getpwnam(name)
            break
        except KeyError:
            pass
        argv = ["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", "--comment",
                TEST_USER_COMMENT, name]
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=30)
        if done.returncode == 10:  # /etc/passwd locked: another test process is making its users
            time.sleep(0.5)
        elif done.returncode not in (0, 9):  # 9: made meanwhile by another test process
            pytest.fail(f"useradd {name}: {done.stderr}")
    else:
        pytest.fail(f"could not make user {name}: /etc/passwd stayed locked")
    if entry.pw_gecos != TEST_USER_COMMENT:
        pytest.skip(f"a user {name} exists on this host and is not the tests' own: not using it")


def make_users() -> None:
    """Both test users, or a skip saying why not (not root, no useradd/runuser)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: makes Unix users and runs clients as them")
    for tool in ("useradd", "runuser"):
        if not shutil.which(tool):
            pytest.skip(f"needs `{tool}`")
    for name in (ALICE, BOB):
        ensure_user(name)


def python_for_users() -> list[str]:
    """A Python that the test users can run, with this venv's packages. The venv's own interpreter may lie
    in root's home (pyenv, mode 0700): then the system's Python of the same version, with the venv's
    site-packages (readable by all) added; nothing is copied."""
    probe = "import hpcserve.tenancy.selfservice"
    system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [[sys.executable, "-s", "-c"],  # each runs [*candidate, code]
                  [system, "-s", "-c", f"import site, sys; site.addsitedir({str(VENV_SITE)!r}); exec(sys.argv[1])"]]
    said = []
    for argv in candidates:
        done = subprocess.run(["runuser", "-u", ALICE, "--", *argv, probe], check=False, capture_output=True,
                              text=True, timeout=60, cwd="/")
        if done.returncode == 0:
            return argv
        said.append(f"{argv[0]}: {done.stderr.strip()[-300:]}")
    pytest.skip("no Python the test users can run with hpcserve importable: " + "; ".join(said))
