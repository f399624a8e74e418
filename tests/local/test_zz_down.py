"""Last of tests/local: `hpcserve down` of the shared local deployment leaves nothing running."""

from __future__ import annotations

import psutil
import pytest
from helpers import alive, run_cli

pytestmark = pytest.mark.slow


def test_down_leaves_no_process(local_deployment):
    tree = local_deployment["driver_tree"]
    assert len(tree) > 5  # driver, node, ray start, gcs, raylet, engine host, vLLM ...
    down = run_cli("down", local_deployment["name"])
    assert down.returncode == 0, down.stderr
    left = alive(tree)
    assert not left, [(p.pid, p.cmdline()[:3]) for p in left]
    assert not any(c.laddr.port == local_deployment["port"] for c in psutil.net_connections("tcp") if c.status == "LISTEN")
    status = run_cli("status", local_deployment["name"])
    assert status.returncode == 2 and "no deployment named" in status.stderr
