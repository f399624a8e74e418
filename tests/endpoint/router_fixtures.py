"""Shared pieces of the router tests: backend processes started and stopped by PID, a key file,
streaming reads with chunk arrival times, and a concurrent load that counts failures."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import helpers
import httpx
from helpers import free_port

from hpcserve.testing.harness import stop  # noqa: F401 - the tests import it from here

KEY = "router-test-key"


def key_file(directory: Path, key: str = KEY) -> Path:
    path = directory / "api_key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


def start_stub(name: str, log_dir: Path, token_delay_ms: float = 20.0, key: str = KEY,
               slots: int | None = None, tokens: int | None = None) -> tuple[subprocess.Popen, str]:
    return start_stubs([name], log_dir, token_delay_ms, key, slots and [slots], tokens)[0]


def start_stubs(names: list[str], log_dir: Path, token_delay_ms: float = 20.0, key: str = KEY,
                slots: list[int] | None = None, tokens: int | None = None,
                extra: list[str] = ()) -> list[tuple[subprocess.Popen, str]]:
    """Stand-ins started together (each takes about a second to import its web server), then awaited.
    extra: more stand-in flags for all of them (e.g. --first-token-delay-ms)."""
    started = []
    for index, name in enumerate(names):
        port = free_port()
        argv = [sys.executable, "-m", "hpcserve.testing.standin", "--port", str(port), "--name", name,
                "--token-delay-ms", str(token_delay_ms), *extra]
        argv += ["--slots", str(slots[index])] if slots else []
        argv += ["--tokens", str(tokens)] if tokens else []
        with open(log_dir / f"stub-{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=log, env={**os.environ, "HPCSERVE_STUB_API_KEY": key},
                                    start_new_session=True)
        started.append((proc, f"http://127.0.0.1:{port}"))
    deadline = time.monotonic() + 30
    for proc, url in started:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                for other, _ in started:
                    stop(other)
                raise RuntimeError(f"stub at {url} did not start (see {log_dir})")
            time.sleep(0.05)
    return started


def wait_for(condition, timeout_s: float = 10.0) -> None:
    """Until condition() holds (polled every 50 ms); fails the test after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def stub_stats(url: str) -> dict:
    return httpx.get(f"{url}/stub/stats", timeout=5).json()


def headers(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def stream_times(base_url: str, body: dict, key: str = KEY, timeout: float = 120) -> tuple[list[float], list[str]]:
    """POST a streamed request; return each SSE data line's arrival time (s since sent) and the lines."""
    return helpers.stream_times(base_url, body, key, timeout)


def streamed(base_url: str, body: dict, key: str = KEY, timeout: float = 300, under_way=None) -> dict:
    return helpers.streamed(base_url, body, key, timeout, under_way)


@dataclass
class LoadResult:
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    served_by: dict[str, int] = field(default_factory=dict)


def run_load(base_url: str, model: str, stop_event: threading.Event, workers: int = 4, max_tokens: int = 8,
             key: str = KEY, prompt: str = "Hello, my name is") -> tuple[list[threading.Thread], LoadResult]:
    """Non-streamed completions from `workers` threads until stop_event is set (bounded by it)."""
    result, lock = LoadResult(), threading.Lock()

    def loop(index: int) -> None:
        with httpx.Client(timeout=120, trust_env=False) as client:
            count = 0
            while not stop_event.is_set():
                count += 1
                body = {"model": model, "prompt": f"{prompt} {index}-{count}", "max_tokens": max_tokens,
                        "temperature": 0}
                try:
                    response = client.post(f"{base_url}/v1/completions", json=body, headers=headers(key))
                    good = response.status_code == 200 and response.json().get("choices")
                    error = None if good else f"HTTP {response.status_code}: {response.text[:200]}"
                    by = response.headers.get("x-backend") if good else None  # the stub names itself
                except httpx.HTTPError as exc:
                    error, by = f"{type(exc).__name__}: {exc}", None
                with lock:
                    if error:
                        result.failed.append(error)
                    else:
                        result.ok += 1
                        result.served_by[str(by)] = result.served_by.get(str(by), 0) + 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    return threads, result
