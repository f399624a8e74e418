"""Shared helpers for tests that run the real hpcserve command and real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
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
UNDER_WAY_EVENTS = 5  # SSE events a stream has sent when a test calls it under way


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


def stream_times(base_url: str, body: dict, key: str, timeout: float = 120,
                 under_way: threading.Event | None = None) -> tuple[list[float], list[str]]:
    """POST a streamed completion (or chat, with `messages`); return each SSE data line's arrival time (s
    since sent) and the lines. `under_way` is set once UNDER_WAY_EVENTS lines came (the stream is running:
    what a test waits for before it drains or kills the stream's replica)."""
    import httpx

    times, lines = [], []
    start = time.monotonic()
    with httpx.stream("POST", f"{base_url}/v1/{'chat/completions' if 'messages' in body else 'completions'}",
                      json={**body, "stream": True}, headers={"Authorization": f"Bearer {key}"},
                      timeout=timeout) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:"):
                times.append(time.monotonic() - start)
                lines.append(line)
                if under_way is not None and len(lines) == UNDER_WAY_EVENTS:
                    under_way.set()
    return times, lines


def streamed(base_url: str, body: dict, key: str, timeout: float = 300,
             under_way: threading.Event | None = None) -> dict:
    """A streamed completion or chat, read whole: its text, finish_reason, events, whether [DONE] came, and
    any error event (what a client of the endpoint sees)."""
    times, lines = stream_times(base_url, body, key, timeout, under_way)
    text, ids, finish, errors = [], [], None, []
    for line in lines:
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            continue
        event = json.loads(payload)
        if "error" in event:
            errors.append(event["error"])
        for choice in event.get("choices") or []:
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            ids.extend(choice.get("token_ids") or [])  # where the body asked for them (return_token_ids)
            finish = choice.get("finish_reason") or finish
    return {"text": "".join(text), "ids": ids, "finish": finish, "events": len(lines),
            "done": lines[-1:] == ["data: [DONE]"], "errors": errors, "seconds": times[-1] if times else 0.0}
