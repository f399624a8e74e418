"""Acceptance: `hpcserve bench` measures what vLLM's own `vllm bench serve` measures, on a real vLLM server.

Both clients drive the same CPU vLLM server with the same load shape (random text prompts of 64 tokens,
32 output tokens with ignore_eos, 4 requests in flight). This 2-core
machine is shared with other jobs whose load swings throughput by 2-3x within a minute, so runs taken
one after another cannot agree to 5%.
Instead the two clients run at the same time against the same server (each with its own 4 slots and
its own fresh prompts): whatever the machine does hits both alike. Throughput is compared over the window
both were running, from each client's own per-request records (a client alone on the server runs faster:
comparing whole runs compared how long each ran alone; CI saw a pair at 1.57x from that). TTFT likewise,
over the requests each client sent inside that window (vllm bench's requests sent while it ran alone met
half the load: its median TTFT looked 0.7x ours, and a clean-clone run failed on it). Repeated PAIRS
times (one in the suite); medians.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import HPCSERVE, SMALL_KV_CACHE, free_port, own_tmp_env

INPUT_LEN, OUTPUT_LEN, CONCURRENCY, NUM_PROMPTS = 64, 32, 4, 120
THEIR_PROMPTS = 200  # vllm bench's run spans ours (which starts a few seconds into it), so the window is ours
MIN_WINDOW_S = 3.0
# Closed loop (fixed concurrency, no request rate): with Poisson arrivals the throughput of N requests is
# set by the sampled arrival span (+-9% for N=120), and the two tools draw different samples.
# Each pair starts a `vllm bench` process (~20 s) while the other worker idles: one pair, whose throughput
# ratios have stayed within 2 % of 1 (pairs 0.997, 0.997, 1.007) and TTFT's within its bounds (0.82-1.22);
# HPCSERVE_BENCH_PAIRS=3 takes the median of three.
PAIRS = int(os.environ.get("HPCSERVE_BENCH_PAIRS", "1"))
# Closed loop on 2 cores shared by the server and both clients: how fast a client turns a finished request
# into the next one lands in its throughput. Measured here (median of 3 pairs): 0.99-1.01 with our client
# in the pytest process on an idle machine, 0.90 in CI's full run (the pytest process after 700 tests),
# 1.04 as a process of its own (pairs 0.99-1.06, 2026-12-03), whole runs compared. A wrong count or clock is
# off by far more. Over the shared window (2026-12-05, idle machine): pairs 0.997, 0.997, 1.007.
TOLERANCE = 0.08
TTFT_P50_BOUNDS = (0.6, 1.35)  # why so wide: the test's last assertion
# A pair outside the bounds is confirmed by the median of this many pairs (noise, or a real difference).
CONFIRM_PAIRS = 3
SERVER_READY_S = 180


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
    model, port = _tiny_model(), free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    argv = [sys.executable, "-m", "hpcserve.engine.vllm_cli", "serve", str(model), "--served-model-name", "tiny",
            "--dtype", "float32", "--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", *SMALL_KV_CACHE]  # what is compared is the load generators, not vLLM's compile path
    env = own_tmp_env(log.parent)
    with open(log, "wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, base_url, log)
        yield base_url, model
    finally:
        _stop(process)


def _text_prompts(model: Path, count: int, seed: int, path: Path) -> Path:
    """Prompts made the way vllm bench's random dataset makes them (random ids -> text -> re-encoded and cut
    to INPUT_LEN tokens -> text), so the server does the same work (tokenising text) for both clients."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    allowed = [t for t in range(tokenizer.vocab_size) if t not in set(tokenizer.all_special_ids)]
    with path.open("w") as sink:
        for _ in range(count):
            text = tokenizer.decode([rng.choice(allowed) for _ in range(INPUT_LEN)])
            text = tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids[:INPUT_LEN])
            sink.write(json.dumps({"prompt": text, "output_len": OUTPUT_LEN}) + "\n")
    return path


def _start_vllm_bench(base_url: str, model: Path, seed: int, result_file: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "hpcserve.engine.vllm_cli", "bench", "serve", "--backend", "openai",
            "--base-url", base_url, "--model", "tiny", "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--num-prompts", str(THEIR_PROMPTS), "--max-concurrency", str(CONCURRENCY), "--ignore-eos",
            "--seed", str(seed), "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-filename", str(result_file)]
    # its temporary files (importing vLLM makes $TMPDIR/torchinductor_USER) in the test's folder, not /tmp
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=own_tmp_env(result_file.parent, PYTHONUNBUFFERED="1"), start_new_session=True)


def _wait_for_main_run(process: subprocess.Popen) -> None:
    """vllm bench prints this line right before its timed run starts (after ~10 s of imports and a test prompt)."""
    for line in process.stdout:
        if line.startswith("Maximum request concurrency"):
            return
    pytest.fail(f"vllm bench serve exited ({process.wait()}) before its main run")


def _vllms_result(process: subprocess.Popen, result_file: Path) -> dict:
    output, _ = process.communicate(timeout=180)
    assert process.returncode == 0, output[-3000:]
    data = json.loads(result_file.read_text())
    assert data["failed"] == 0
    # vllm bench's start times are time.perf_counter(): CLOCK_MONOTONIC, one clock for every process here
    to_epoch = time.time() - time.perf_counter()
    spans = [(to_epoch + start, to_epoch + start + latency, tokens, ttft) for start, latency, tokens, ttft
             in zip(data["start_times"], data["latencies"], data["output_lens"], data["ttfts"])]
    return {"input_tokens": data["total_input_tokens"], "spans": spans}


def _start_ours(base_url: str, dataset: Path, result_file: Path) -> subprocess.Popen:
    """`hpcserve bench` as a user runs it: a process of its own, as vllm bench is. (In the pytest process, after
    700 tests, its event loop shared the interpreter with whatever earlier tests left there: 0.90x of
    vLLM's throughput in CI's full run, 0.99-1.01x alone.) Its one warm-up request is not measured."""
    argv = [*HPCSERVE, "bench", base_url, "--model", "tiny", "--dataset", str(dataset), "--num-prompts",
            str(NUM_PROMPTS), "--concurrency", str(CONCURRENCY), "--output-len", str(OUTPUT_LEN), "--timeout", "180",
            "--out", str(result_file)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _our_result(process: subprocess.Popen, result_file: Path) -> dict:
    output, _ = process.communicate(timeout=180)
    assert process.returncode == 0, output[-3000:]
    run = json.loads(result_file.read_text())["runs"][0]
    summary = run["summary"]
    assert summary["failed"] == 0, summary["first_errors"]
    spans = [(run["started_at"] + r["start_s"], run["started_at"] + r["start_s"] + r["e2e_s"], r["output_tokens"],
              r["ttft_s"]) for r in run["requests"]]
    return {"input_tokens": summary["total_input_tokens"], "spans": spans}


def _rates_within(spans: list[tuple[float, float, int, float]], window: tuple[float, float]) -> dict:
    """Requests/s and output tokens/s inside the window, each request counted by the share of its span inside;
    TTFT of the requests sent inside it."""
    begin, end = window
    shares = [(max(0.0, min(stop, end) - max(start, begin)) / (stop - start), tokens)
              for start, stop, tokens, _ in spans]
    ttfts_ms = [1000.0 * ttft for start, _, _, ttft in spans if begin <= start <= end]
    return {"req_s": sum(share for share, _ in shares) / (end - begin),
            "out_tok_s": sum(share * tokens for share, tokens in shares) / (end - begin),
            "ttft_mean_ms": statistics.mean(ttfts_ms), "ttft_p50_ms": statistics.median(ttfts_ms)}


def _in_shared_window(ours: dict, theirs: dict) -> tuple[dict, dict]:
    """Both clients' throughput and TTFT over the time both were sending; the window's length is kept with it."""
    window = (max(min(s[0] for s in side["spans"]) for side in (ours, theirs)),
              min(max(s[1] for s in side["spans"]) for side in (ours, theirs)))
    assert window[1] - window[0] >= MIN_WINDOW_S, f"the clients ran together for {window[1] - window[0]:.1f} s only"
    return tuple({**{k: v for k, v in side.items() if k != "spans"}, **_rates_within(side["spans"], window),
                  "window_s": window[1] - window[0]} for side in (ours, theirs))


def _paired_run(base_url: str, model: Path, index: int, folder: Path) -> tuple[dict, dict]:
    """Both clients at once, each with its own CONCURRENCY slots and its own fresh prompts. Ours starts when
    vllm bench starts its timed run and ends before it; throughput is compared over the window both ran."""
    dataset = _text_prompts(model, NUM_PROMPTS, seed=500 + index, path=folder / f"prompts-{index}.jsonl")
    theirs_file, ours_file = folder / f"vllm-{index}.json", folder / f"ours-{index}.json"
    processes = [_start_vllm_bench(base_url, model, seed=index, result_file=theirs_file)]
    try:
        _wait_for_main_run(processes[0])
        processes.append(_start_ours(base_url, dataset, ours_file))
        return _in_shared_window(_our_result(processes[1], ours_file), _vllms_result(processes[0], theirs_file))
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.mark.slow
def test_throughput_and_ttft_agree_with_vllm_bench_serve(vllm_server, tmp_path):
    """Same server, same load shape, same time: the machine's noise (other jobs) hits both clients alike.

    TTFT follows vLLM's definition on both sides: from just before the request is sent to the first SSE
    chunk carrying `choices` (even with empty text). Each pair gives a ratio ours/vLLM per metric; the
    assertion is on the median ratio over the pairs.
    """
    base_url, model = vllm_server
    pairs = [_paired_run(base_url, model, index, tmp_path) for index in range(PAIRS)]
    if len(pairs) < CONFIRM_PAIRS and not agree(median_ratios(pairs)):
        # One pair outside the bounds: the machine's noise (one pair at 1.098 in a clean-clone run, 2026-12-07)
        # or a real difference, which the median of three shows as well.
        pairs += [_paired_run(base_url, model, index, tmp_path) for index in range(len(pairs), CONFIRM_PAIRS)]
    ratios = median_ratios(pairs)
    print(json.dumps({"pairs": pairs, "median_ratio_ours_over_vllm": ratios}, indent=1))
    # TTFT: the median. The mean is dominated by the few requests caught in a stall when other jobs on
    # this machine spike (seen: per-pair mean ratios 0.8-1.9 while medians stayed close); it is printed.
    for metric in ("req_s", "out_tok_s"):
        assert abs(ratios[metric] - 1) <= TOLERANCE, f"{metric}: hpcserve/vllm = {ratios[metric]:.3f} ({pairs})"
    # TTFT: the definitions are the same (checked against vllm/benchmarks/lib/endpoint_request_func.py), but
    # on 2 cores the clients' own event-loop lag and where each request lands in the server's batches land in
    # TTFT. Measured: our median TTFT 0.73-0.81 of vLLM's with our client in the pytest process (2026-11-30,
    # 5 pairs each, 3 runs); as a process of its own, per-pair ratios 1.22, 0.82, 1.13 (CI's run of
    # 2026-12-03, median 1.13, while throughput agreed to 1.6 %). Whole runs against ours in the window (vllm
    # bench alone at its start and end): pairs 1.45, 1.39, 0.99 (a clean clone, 2026-12-05); both in the
    # window, two runs on an idle machine: medians 0.999 and 0.956 (pairs 0.985, 0.881, 0.956). A wrong clock
    # is off by far more: to the last token instead of the first is about 30 decode steps, several times the TTFT.
    assert TTFT_P50_BOUNDS[0] <= ratios["ttft_p50_ms"] <= TTFT_P50_BOUNDS[1], \
        f"ttft_p50_ms: hpcserve/vllm = {ratios['ttft_p50_ms']:.3f}"


def median_ratios(pairs: list[tuple[dict, dict]]) -> dict[str, float]:
    """Per metric, the median over the pairs of ours / vLLM's."""
    return {metric: statistics.median(ours[metric] / theirs[metric] for ours, theirs in pairs)
            for metric in ("req_s", "out_tok_s", "ttft_mean_ms", "ttft_p50_ms")}


def agree(ratios: dict[str, float]) -> bool:
    """Whether the ratios are within the bounds the test asserts."""
    return (all(abs(ratios[metric] - 1) <= TOLERANCE for metric in ("req_s", "out_tok_s"))
            and TTFT_P50_BOUNDS[0] <= ratios["ttft_p50_ms"] <= TTFT_P50_BOUNDS[1])
