"""Shared helpers for tests that run the real hpcserve command and real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import yaml

from hpcserve.testing.harness import port_block

REPO = Path(__file__).resolve().parents[1]


def free_port(block: int = 3) -> int:
    """A port for a listener a test starts, with the next block - 1 free too (a local deployment's router
    on serve.port, its replicas after it), outside Ray's worker ports and the ephemeral range."""
    return port_block(block)


RESULTS_DIRS: list[Path] = []  # results folders of deployments several tests share: where to look on failure
HPCSERVE = [sys.executable, "-m", "hpcserve.cli"]
# The tiny model's KV cache in the tests' engines (16,384 tokens): vLLM on CPU allocates its whole cache at
# start (up to 7-10 s per GiB on this machine, with its memory in use: docs/testing.md). Overrides of
# engine.args repeat it.
SMALL_KV_CACHE = ["--kv-cache-memory-bytes", str(64 * 2**20)]


def own_tmp_env(folder: Path, **extra: str) -> dict[str, str]:
    """The environment for a process a test starts by hand (a vLLM engine outside any deployment), with its
    temporary files (vLLM's ZMQ IPC sockets, named by UUIDs) in the test's own folder: an engine the test
    kills leaves them there, not in the /tmp that tests/cluster/test_leftovers.py watches."""
    tmp = Path(folder) / "t"  # short: a Unix socket path has at most 107 bytes
    tmp.mkdir(mode=0o700, exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp), **extra}


def run_cli(*args: str, env: dict | None = None, timeout: float = 900, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*HPCSERVE, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def run_cli_here(*args: str) -> subprocess.CompletedProcess:
    """The same command in this process (typer's CliRunner): for many calls that end before anything starts,
    where a process each (1-1.5 s of imports) was most of the fast tests' time. What only a process shows
    (no traceback on stderr, the exit code of `python -m hpcserve.cli`) stays with run_cli."""
    from typer.testing import CliRunner

    from hpcserve.cli.main import app

    result = CliRunner().invoke(app, list(args), prog_name="hpcserve")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a crash is a crash: its traceback, not an exit code
    return subprocess.CompletedProcess(["hpcserve", *args], result.exit_code, result.stdout, result.stderr)


def write_config(path: Path, base: Path | dict, **overrides) -> Path:
    """A copy of a config with nested overrides, e.g. serve={'port': 1234}."""
    data = yaml.safe_load(Path(base).read_text()) if isinstance(base, Path) else dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out
