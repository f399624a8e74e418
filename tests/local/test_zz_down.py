"""Last of tests/local: `hpcserve down` of the shared local deployment leaves nothing running, and nothing
of Ray's in /tmp: each node's Ray folder (/tmp/hps-UID-RANDOM/HOST, its session in it) is removed, and no
session of it went to Ray's default /tmp/ray."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
from helpers import alive, run_cli

from hpcserve.core.paths import RunPaths
from hpcserve.raycluster.nodefiles import recorded_temp_dirs

pytestmark = pytest.mark.slow


def test_down_leaves_no_process_and_no_ray_folder(local_deployment):
    tree = local_deployment["driver_tree"]
    assert len(tree) > 5  # driver, node, ray start, gcs, raylet, engine host, vLLM ...
    run_dir = local_deployment["run_dir"]
    temps = [t for d in [run_dir, *RunPaths(run_dir).member_run_dirs()] for t in recorded_temp_dirs(d)]
    sessions = [Path(os.readlink(t / "session_latest")).name for t in temps]
    assert temps and all(name.startswith("session_") for name in sessions), (temps, sessions)
    down = run_cli("down", local_deployment["name"])
    assert down.returncode == 0, down.stderr
    left = alive(tree)
    assert not left, [(p.pid, p.cmdline()[:3]) for p in left]
    assert not any(c.laddr.port == local_deployment["port"] for c in psutil.net_connections("tcp") if c.status == "LISTEN")
    status = run_cli("status", local_deployment["name"])
    assert status.returncode == 2 and "no deployment named" in status.stderr
    left = [path for t in temps for path in (t, t.parent) if path.exists()]
    left += [Path("/tmp/ray") / name for name in sessions if (Path("/tmp/ray") / name).exists()]
    assert not left, f"Ray's folders survived `down`: {left}"
