"""Layers 3-4 on the sandbox: vLLM (CPU) across nodes through hpcserve's Ray layer.

- tensor parallel 2 and pipeline parallel 2 across two nodes (vLLM's multi-node mp mode) answer
  token-identically to TP=1;
- Ray refuses clients without the deployment's token;
- an engine that fails to start makes `up` fail with the engine's own error, nothing left running.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from helpers import SMALL_KV_CACHE, run_cli, write_config
from test_slurm_ray import squeue_empty

from hpcserve import api

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]
HERE = Path(__file__).parent
PROMPT_IDS = [5, 17, 42, 99, 7, 123, 64, 300]
GREEDY: dict[str, list[int]] = {}


def greedy_ids(url: str, key: str) -> list[int]:
    reply = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                       json={"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 16, "temperature": 0,
                             "ignore_eos": True, "return_token_ids": True})
    reply.raise_for_status()
    return reply.json()["choices"][0]["token_ids"]


@functools.cache
def transformers_greedy() -> list[int]:
    """Single-node TP=1 reference (tests/local shows vLLM TP=1 equals transformers token for token)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpcserve.models.tiny import tiny_model_path

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), torch_dtype=torch.float32)
    ids = torch.tensor([PROMPT_IDS])
    return model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(PROMPT_IDS):].tolist()


def status_of(name: str) -> dict:
    """The row `hpcserve status NAME --json` prints, read in-process: the tests poll it every second or
    less while engines start, and a CLI process per poll (1-1.5 s of imports each) kept one of this
    machine's two cores busy, starving the engine being waited for. `deployed` reads it once through
    the CLI, so the command itself stays covered."""
    return api.status(name)[0].to_json()


def cli_status_of(name: str) -> dict:
    return json.loads(run_cli("status", name, "--json").stdout)[0]


@contextmanager
def deployed(config: Path, name: str):
    """`hpcserve up` (must succeed), the deployment's status, then `down` and an empty queue."""
    done = run_cli("up", str(config), "--timeout", "900", timeout=1000)
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        yield cli_status_of(name)
    finally:
        assert run_cli("down", name).returncode == 0
    assert squeue_empty(os.environ)


def test_tensor_parallel_across_two_nodes_matches_tp1(slurm_env, tmp_path):
    config = write_config(tmp_path / "tp2.yaml", HERE / "sandbox-tp2.yaml", results_dir=str(tmp_path / "results"))
    with deployed(config, "sb-tp2") as status:
        replica = status["replicas"][0]
        assert status["status"] == "ready" and replica["healthy"]
        assert sorted(replica["nodes"]) == slurm_env.node_names()[:2]  # one vLLM process per node
        assert [p["rank"] for p in replica["processes"]] == [0, 1]
        GREEDY["tp2"] = greedy_ids(replica["url"], os.environ["HPCSERVE_API_KEY"])
        assert GREEDY["tp2"] == transformers_greedy()
        check_ray_refuses_strangers(Path(status["members"][0]["run_dir"]))  # the replica's own job


def test_pipeline_parallel_across_two_nodes_matches_tp1(slurm_env, tmp_path):
    config = write_config(tmp_path / "pp2.yaml", HERE / "sandbox-pp2.yaml", results_dir=str(tmp_path / "results"))
    with deployed(config, "sb-pp2") as status:
        replica = status["replicas"][0]
        assert sorted(replica["nodes"]) == slurm_env.node_names()[:2]  # one stage per node
        assert greedy_ids(replica["url"], os.environ["HPCSERVE_API_KEY"]) == transformers_greedy()


def check_ray_refuses_strangers(run_dir: Path) -> None:
    """With the run's token a client connects; without it the GCS refuses (token authentication)."""
    gcs = json.loads((run_dir / "state.json").read_text())["ray"]["gcs"]
    code = f"import ray; ray.init(address='{gcs}'); print('CONNECTED', len(ray.nodes()))"
    base = {"PATH": os.environ["PATH"], "HOME": str(run_dir), "RAY_USAGE_STATS_ENABLED": "0"}
    ours = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(run_dir / "ray_auth_token")})
    assert "CONNECTED 2" in ours.stdout, ours.stderr[-2000:]
    output = output_until_refused([sys.executable, "-c", code], {**base, "RAY_AUTH_MODE": "disabled"}, timeout_s=30)
    assert "CONNECTED" not in output
    assert any(word in output for word in REFUSALS), output[-2000:]


REFUSALS = ("Unauthenticated", "InvalidAuthToken")


def output_until_refused(argv: list[str], env: dict, timeout_s: float) -> str:
    """A client's output until it prints a refusal (it keeps retrying after one: it is stopped then), exits,
    or timeout_s passes."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    refused = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if any(word in line for word in REFUSALS):
                refused.set()
        refused.set()  # exited

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    refused.wait(timeout_s)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join(timeout=10)
    return "".join(lines)


def test_engine_that_fails_to_start_fails_up_with_its_own_error(slurm_env, tmp_path):
    config = write_config(tmp_path / "bad.yaml", HERE / "sandbox-replicas.yaml", name="sb-bad",
                          results_dir=str(tmp_path / "results"),
                          cluster={"nodes": 1}, parallelism={"tensor": 1, "pipeline": 1, "replicas": 1},
                          engine={"executor": "mp", "args": ["--enforce-eager", "--max-model-len", "999999", *SMALL_KV_CACHE]})
    done = run_cli("up", str(config), "--timeout", "600", timeout=700)
    text = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1, text
    assert "stage 'engine'" in text and "999999" in text, text  # vLLM's own words about the bad length
    assert f"engines/replica0-rank0-{slurm_env.node_names()[0]}.log" in text  # the log to read
    assert "Traceback" not in text
    assert squeue_empty(os.environ)
