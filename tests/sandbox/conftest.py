"""Fixtures for tests against a real sandbox Slurm cluster (see hpcserve.sandbox.cluster).

Other test folders get the same cluster with `hpcserve.sandbox.cluster.ensure_sandbox()`.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from hpcserve.sandbox.cluster import Sandbox, ensure_sandbox

SANDBOX_NODES = 3


def sandbox_unusable_reason() -> str | None:
    """Why the sandbox cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the Slurm sandbox needs root (network namespaces, mounts)"
    for tool in ("ip", "nsenter", "unshare"):
        if not shutil.which(tool):
            return f"the Slurm sandbox needs `{tool}` (iproute2 / util-linux)"
    for probe in (["ip", "netns", "list"], ["unshare", "--net", "--pid", "--fork", "true"]):
        try:
            done = subprocess.run(probe, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"`{' '.join(probe)}` failed: {exc}"
        if done.returncode != 0:
            return f"namespaces are not usable here: `{' '.join(probe)}`: {done.stderr.strip()}"
    return None


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    """A running 3-node sandbox, shared by the whole test session and stopped at its end."""
    reason = sandbox_unusable_reason()
    if reason:
        pytest.skip(reason)
    cluster = ensure_sandbox(nodes=SANDBOX_NODES)
    yield cluster
    cluster.down()
