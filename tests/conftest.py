import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def hpcserve_home(tmp_path_factory) -> Path:
    """A private registry for the test session: tests never see the user's deployments."""
    home = tmp_path_factory.mktemp("hpcserve-home")
    mp = pytest.MonkeyPatch()
    mp.setenv("HPCSERVE_HOME", str(home))
    yield home
    mp.undo()


# ---------------------------------------------------------------- the Slurm sandbox

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
def sandbox():
    """A running 3-node sandbox, shared by the whole test session and stopped at its end."""
    reason = sandbox_unusable_reason()
    if reason:
        pytest.skip(reason)
    from hpcserve.sandbox.cluster import ensure_sandbox

    cluster = ensure_sandbox(nodes=SANDBOX_NODES)
    yield cluster
    cluster.down()
