"""Acceptance: `hpcserve bench` measures what vLLM's own `vllm bench serve` measures, on a real vLLM server.

Both clients drive the same CPU vLLM server with the same load shape (random prompts of 64 tokens,
32 output tokens with ignore_eos, fixed concurrency). This 2-core machine is shared and noisy, so the
runs alternate in an ABBA order (drift hits both sides alike), every run uses fresh prompts (no
prefix-cache advantage for whoever runs second), and we compare the medians over the repetitions.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hpcserve.benchmark.cli import bench
from hpcserve.benchmark.loadgen import LoadShape
from hpcserve.benchmark.runner import BenchOptions, run_benchmark
from hpcserve.benchmark.summary import load_result
from hpcserve.benchmark.workload import LengthRange
from hpcserve.state import Endpoint

INPUT_LEN, OUTPUT_LEN, CONCURRENCY, NUM_PROMPTS = 64, 32, 4, 200
REPETITIONS = 3  # per client; order O V V O O V
TOLERANCE = 0.05
SERVER_READY_S = 180


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tiny_model() -> Path:
    from hpcserve.models.tiny import tiny_model_path

    return tiny_model_path()


def _completion_works(base_url: str) -> bool:
    try:
        response = httpx.post(f"{base_url}/v1/completions", timeout=10, trust_env=False,
                              json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
        return response.status_code == 200
    except httpx.HTTPError:
        return False


def _wait_ready(process: subprocess.Popen, base_url: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_READY_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vLLM exited with {process.returncode} before it was ready:\n{log.read_text()[-3000:]}")
        if _completion_works(base_url):
            return
        time.sleep(1)
    pytest.fail(f"vLLM not ready after {SERVER_READY_S} s:\n{log.read_text()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (its engine workers included), SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    model, port = _tiny_model(), _free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    argv = [sys.executable, "-m", "hpcserve.engine.vllm_cli", "serve", str(model), "--served-model-name", "tiny",
            "--dtype", "float32", "--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, base_url, log)
        yield base_url, model
    finally:
        _stop(process)


def _ours(base_url: str, seed: int, warmup: int = 1) -> dict:
    options = BenchOptions(loads=(LoadShape(concurrency=CONCURRENCY),), num_prompts=NUM_PROMPTS,
                           input_len=LengthRange(INPUT_LEN, INPUT_LEN), output_len=OUTPUT_LEN, seed=seed,
                           timeout_s=120, warmup_requests=warmup)
    summary = run_benchmark([Endpoint(base_url, "tiny", None)], options).runs[0].summary
    assert summary.failed == 0, summary.first_errors
    return {"req_s": summary.request_throughput, "out_tok_s": summary.output_throughput,
            "ttft_mean_ms": summary.ttft_ms.mean, "ttft_p50_ms": summary.ttft_ms.p50, "dur": summary.duration_s}


def _vllms(base_url: str, model: Path, seed: int, result_file: Path) -> dict:
    argv = [sys.executable, "-m", "hpcserve.engine.vllm_cli", "bench", "serve", "--backend", "openai",
            "--base-url", base_url, "--model", "tiny", "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", str(CONCURRENCY), "--ignore-eos",
            "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-filename", str(result_file)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads(result_file.read_text())
    assert data["failed"] == 0
    return {"req_s": data["request_throughput"], "out_tok_s": data["output_throughput"],
            "ttft_mean_ms": data["mean_ttft_ms"], "ttft_p50_ms": data["median_ttft_ms"]}


def _relative_gap(ours: float, theirs: float) -> float:
    return abs(ours - theirs) / theirs


@pytest.mark.slow
def test_throughput_and_ttft_agree_with_vllm_bench_serve(vllm_server, tmp_path):
    base_url, model = vllm_server
    ours, theirs = [], []
    for index, who in enumerate("OVVOOV"[: 2 * REPETITIONS]):
        seed = 1000 + index  # fresh prompts every run: the prefix cache favours no one
        if who == "O":
            ours.append(_ours(base_url, seed))
        else:
            theirs.append(_vllms(base_url, model, seed, tmp_path / f"vllm-{index}.json"))
    report = {}
    for metric in ("req_s", "out_tok_s", "ttft_mean_ms", "ttft_p50_ms"):
        mine, vllm = statistics.median(r[metric] for r in ours), statistics.median(r[metric] for r in theirs)
        report[metric] = (mine, vllm, _relative_gap(mine, vllm))
    print(json.dumps({"ours": ours, "vllm": theirs, "medians_and_gap": report}, indent=1))
    for metric in ("req_s", "out_tok_s", "ttft_mean_ms"):
        mine, vllm, gap = report[metric]
        assert gap <= TOLERANCE, f"{metric}: hpcserve {mine:.2f} vs vllm bench {vllm:.2f} ({100 * gap:.1f}% apart)"
