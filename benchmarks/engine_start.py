"""Time to the first completion of one vLLM (CPU) engine of the builtin tiny model, two ways compared:

    flock /tmp/hpcserve-heavy.lock .venv/bin/python benchmarks/engine_start.py --rounds 2 [--bind auto] [--compare kv|start]

--compare executor (default): how its one worker runs, with a 1 GiB KV cache
  mp   vLLM on CPU's default for `--distributed-executor-backend uni`: it turns uni into mp, so the worker
       is a process of its own (API server, engine core, worker: three imports of torch and vLLM)
  uni  VLLM_ENABLE_V1_MULTIPROCESSING=0, as hpcserve starts a one-worker replica on CPU
       (engine/replicas.py): the worker runs in the engine core's process (two processes)
--compare kv: uni, with the KV cache the examples had (VLLM_CPU_KVCACHE_SPACE=1, 1 GiB) and the one they
  and the tests have now (--kv-cache-memory-bytes 64 MiB): vLLM on CPU allocates the whole cache at start.
--compare start: uni, 64 MiB, the engine core started as vLLM on CPU starts it (spawn: it imports torch and
  vLLM again) and as hpcserve.engine.vllm_cli does (fork, inheriting them).

Alternating, fresh processes each time, eager mode (the sandbox tests' setting). Prints seconds to the first
completion, vLLM's own "init engine (profile, create kv cache, warmup model)" seconds, the CPU seconds its
processes used until then (less noisy than seconds on a shared machine), and the mean time of 20 short
completions after it (the serving speed must not change).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from hpcserve.core.net import free_loopback_port
from hpcserve.models.tiny import tiny_model_path

UNI = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
GIB_KV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
SMALL_KV = ["--kv-cache-memory-bytes", str(64 * 2**20)]
# variant -> (environment, extra vLLM arguments)
COMPARISONS = {
    "executor": {"mp": (GIB_KV, []), "uni": ({**GIB_KV, **UNI}, [])},
    "kv": {"kv-1GiB": ({**GIB_KV, **UNI}, []), "kv-64MiB": (UNI, SMALL_KV)},
    "start": {"spawn": ({**UNI, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}, SMALL_KV), "fork": (UNI, SMALL_KV)},
}
INIT_LINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s")


def cpu_seconds(pid: int) -> float:
    """User and system CPU of a process and its descendants so far."""
    root = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])


def start_once(model: str, extra_env: dict[str, str], extra_args: list[str], bind: str,
               log: Path) -> tuple[float, float, float]:
    port = free_loopback_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bind, **extra_env}
    if bind == "nobind":
        env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "hpcserve.engine.vllm_cli", "serve", model, "--served-model-name", "tiny",
            "--port", str(port), "--distributed-executor-backend", "uni", "--dtype", "float32",
            "--max-model-len", "512", "--enforce-eager", *extra_args]
    url = f"http://127.0.0.1:{port}/v1/completions"
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the engine exited with {proc.returncode}: see {log}")
            try:
                if httpx.post(url, json={"model": "tiny", "prompt": "Hello", "max_tokens": 8}, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        first, cpu = time.monotonic() - started, cpu_seconds(proc.pid)
        serving = time.monotonic()
        for _ in range(20):
            httpx.post(url, json={"model": "tiny", "prompt": "Hello there", "max_tokens": 16}, timeout=30).raise_for_status()
        return first, cpu, (time.monotonic() - serving) / 20
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bind", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND: nobind (the sandbox's) or auto")
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="executor")
    args = parser.parse_args()
    model = str(tiny_model_path())
    logs = Path(tempfile.mkdtemp(prefix="engine-start-"))
    for round_ in range(args.rounds):
        for variant, (extra_env, extra_args) in COMPARISONS[args.compare].items():
            log = logs / f"{variant}-{round_}.log"
            first, cpu, per_request = start_once(model, extra_env, extra_args, args.bind, log)
            init = INIT_LINE.search(log.read_text())
            print(f"{variant:8} round {round_}: first completion after {first:5.1f} s, {cpu:5.1f} s of CPU (init "
                  f"engine {init.group(1) if init else '?'} s); then {per_request * 1000:.0f} ms per 16-token "
                  "completion", flush=True)
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
