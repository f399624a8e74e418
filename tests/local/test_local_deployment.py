"""The embedded default, for real: `hpcserve up examples/local.yaml` -> Ray -> vLLM on CPU -> answers.

One deployment for every test of tests/local that only reads from it (local_deployment in
tests/local/conftest.py: vLLM takes tens of seconds to start on 2 cores); test_zz_down.py stops it.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from helpers import alive, process_tree, run_cli

pytestmark = pytest.mark.slow
PROMPT = "the quick brown fox"


@pytest.fixture()
def deployment(local_deployment):
    return local_deployment


def client(deployment):
    from openai import OpenAI

    return OpenAI(base_url=deployment["url"] + "/v1", api_key=deployment["key"], timeout=120)


def test_up_reports_ready_with_url_and_a_real_answer(deployment):
    up = deployment["up"]
    assert up.returncode == 0, up.stdout + up.stderr
    assert "ready" in up.stdout
    assert f"http://127.0.0.1:{deployment['port']}/v1" in up.stdout
    assert "answer to 'Hello, my name is':" in up.stdout
    assert "Traceback" not in up.stdout + up.stderr


def test_stages_recorded_in_timeline(deployment):
    timeline = json.loads((deployment["run_dir"] / "timeline.json").read_text())
    done = [e["stage"] for e in timeline if e["event"] == "done"]
    assert done[:4] == ["ray", "health", "engine", "router"]
    member = deployment["status"]["members"][0]  # the replica's own deployment, behind the router
    health = json.loads((Path(member["run_dir"]) / "health.json").read_text())
    assert health["ok"] and len(health["nodes"]) == 1
    assert "where the time went: " in deployment["up"].stdout and "engine " in deployment["up"].stdout


def test_one_endpoint_in_front_of_the_replica(deployment):
    status = deployment["status"]
    assert status["endpoint"] == f"http://127.0.0.1:{deployment['port']}"
    replica = status["replicas"][0]["url"]
    assert replica != status["endpoint"] and status["replicas"][0]["healthy"]
    assert [d["action"] for d in status["decisions"]][:2] == ["launch initial", "join"]


def test_status_tells_ready_and_healthy(deployment):
    status = deployment["status"]
    assert status["status"] == "ready"
    assert [r["healthy"] for r in status["replicas"]] == [True]


def test_completion_and_chat_with_openai_client(deployment):
    api = client(deployment)
    completion = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert completion.usage.completion_tokens == 8 and completion.choices[0].text
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=8, temperature=0)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens >= 1


def test_streaming_completion_and_chat(deployment):
    api = client(deployment)
    chunks = list(api.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert len([c for c in chunks if c.choices and c.choices[0].text]) >= 2
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    assert streamed == whole
    chat_args = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0,
                     extra_body={"ignore_eos": True})
    chat_chunks = list(api.chat.completions.create(**chat_args, stream=True, stream_options={"include_usage": True}))
    assert chat_chunks[-1].usage.completion_tokens == 12
    assert len([c for c in chat_chunks if c.choices]) >= 2
    streamed_chat = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
    assert streamed_chat == api.chat.completions.create(**chat_args).choices[0].message.content


def test_api_key_required(deployment):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    assert httpx.post(deployment["url"] + "/v1/completions", json=body, timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.post(deployment["url"] + "/v1/completions", json=body, headers=wrong, timeout=30).status_code == 401
    replica = deployment["status"]["replicas"][0]["url"]  # the engine itself, every route but /health
    for method, path in (("POST", "/invocations"), ("POST", "/tokenize"), ("GET", "/metrics"), ("GET", "/v1/models")):
        assert httpx.request(method, replica + path, json=body, timeout=30).status_code == 401, path
    assert httpx.get(replica + "/health", timeout=30).status_code == 200


BENCH = ("--num-prompts", "4", "--concurrency", "2", "--input-len", "16", "--output-len", "4")


def test_bench_by_name_finds_the_generated_key(deployment, tmp_path):
    done = run_cli("bench", "t-local", *BENCH, "--out", str(tmp_path / "bench.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "bench.json").read_text())["runs"][0]["summary"]
    assert summary["completed"] == 4 and summary["failed"] == 0


def test_bench_of_a_bare_url_behind_a_key_names_the_option(deployment):
    refused = run_cli("bench", deployment["url"], *BENCH)
    assert refused.returncode == 2
    message = " ".join(refused.stderr.split())
    assert "HTTP 401" in message and "--api-key-env" in message and "Traceback" not in message
    passed = run_cli("bench", deployment["url"], *BENCH, "--api-key-env", "T_KEY", env={"T_KEY": deployment["key"]})
    assert passed.returncode == 0, passed.stdout + passed.stderr


def test_a_one_worker_replica_runs_its_worker_in_the_engine_core(deployment):
    # vLLM on CPU turns the uni executor into mp (a third process, one more import of torch and vLLM at
    # every start) unless hpcserve turns V1 multiprocessing off: the API server and its engine core only.
    member = deployment["status"]["members"][0]
    state = json.loads((Path(member["run_dir"]) / "state.json").read_text())
    server = psutil.Process(state["replicas"][0]["processes"][0]["pid"])
    vllm = [p.name() for p in server.children(recursive=True) if p.name().startswith("VLLM::")]
    assert len(vllm) == 1 and vllm[0].startswith("VLLM::EngineCor"), vllm  # no VLLM::Worker


def test_no_port_of_the_deployment_answers_without_the_key(deployment):
    """Every TCP port the deployment listens on (router, engine, Ray's daemons and agents), on loopback that
    every user of the machine reaches: GET / and /metrics without a key or Ray's token answer nothing (    31: Ray's Prometheus pages answered 200 with actor names, PIDs, the session and job ids)."""
    procs = process_tree(json.loads((deployment["run_dir"] / "state.json").read_text())["driver_pid"])
    listening = set()
    for proc in procs:
        try:
            listening |= {c.laddr.port for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue

    def probe(target: str) -> str | None:
        try:
            reply = httpx.get(f"http://127.0.0.1:{target}", timeout=3, trust_env=False)
        except httpx.HTTPError:  # binary protocols (gRPC, Ray's own): no HTTP answer, some only after the timeout
            return None
        return f"{reply.status_code} {len(reply.text.splitlines())} lines" if reply.status_code < 400 else None

    targets = [f"{port}{path}" for port in sorted(listening) for path in ("/", "/metrics")]
    with ThreadPoolExecutor(len(targets)) as pool:  # at once: one after another, the silent ports took 80 s
        answered = {t: r for t, r in zip(targets, pool.map(probe, targets)) if r is not None}
    assert len(listening) >= 6 and not answered, (sorted(listening), answered)


def test_the_endpoint_follows_the_engines_kv_events(deployment):
    """The embedded default routes by prefix: its data plane reads the model's tokenizer and follows the
    engine's KV events (relayed on the engine's port, behind the key); a prompt of whole blocks (vLLM on
    CPU caches blocks of 128 tokens) shows up in its exact index. The controller told it the engine's KV
    cache size (from the engine's /metrics at join): admission and the index's bound work from it."""
    from hpcserve.core.paths import RunPaths
    from hpcserve.endpoint.control.holding import read_backends
    from hpcserve.engine.client import kv_cache_size
    from hpcserve.testing.harness import wait_until

    socket = RunPaths(Path(deployment["run_dir"])).router_admin
    client(deployment).completions.create(model="tiny", prompt="routing by what the engine holds " * 10, max_tokens=1)
    row = wait_until(lambda: [b for b in read_backends(socket)["backends"] if b.get("exact_blocks")], 30,
                     "blocks in the exact index")[0]
    assert row["kv_events"] == "live" and row["exact_complete"] is True
    assert row["kv_tokens"] == kv_cache_size(row["url"], deployment["key"]) > 0
    assert read_backends(socket)["waiting"] == 0


def test_engine_temporary_files_stay_in_the_node_folder(deployment):
    """vLLM's ZMQ IPC sockets and every other temporary file of the engine are in the node's private Ray
    folder (removed with it), none in the shared /tmp (~60 were left there after `down`)."""
    member = Path(deployment["status"]["members"][0]["run_dir"])
    node = json.loads(next(member.glob("nodes/*/node.json")).read_text())
    state = json.loads((member / "state.json").read_text())
    server = psutil.Process(state["replicas"][0]["processes"][0]["pid"])
    sockets = {c.laddr for p in [server, *server.children(recursive=True)] for c in p.net_connections("unix")
               if c.laddr and not c.laddr.startswith("@")}
    outside = sorted(s for s in sockets if not s.startswith(node["temp_dir"] + "/"))
    assert sockets and not outside, (node["temp_dir"], outside)
    assert server.environ()["TMPDIR"].startswith(node["temp_dir"] + "/")


def test_api_key_not_in_process_list(deployment):
    key = deployment["key"]
    for proc in alive(deployment["driver_tree"]):
        assert key not in " ".join(proc.cmdline())


def test_greedy_output_matches_transformers(deployment, monkeypatch, tmp_path):
    # loading a model imports torch._dynamo, which makes its cache folder, by default $TMPDIR/torchinductor_USER
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torchinductor"))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcserve.models.tiny import tiny_model_path

    path = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, ids.shape[1]:].tolist()
    reply = httpx.post(deployment["url"] + "/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {deployment['key']}"},
                       json={"model": "tiny", "prompt": ids[0].tolist(), "max_tokens": 16, "temperature": 0,
                             "ignore_eos": True, "return_token_ids": True}).json()
    got = reply["choices"][0]["token_ids"]
    assert got == expected


def test_logs_lists_every_component(deployment):
    listing = run_cli("logs", "t-local", "--list").stdout
    for part in ("driver.log", "ray-start.log", "engines/replica0-rank0", "health.json", "timeline.json"):
        assert part in listing, listing
    shown = run_cli("logs", "t-local", "--component", "driver", "--lines", "400").stdout
    assert " INFO hpcserve.endpoint.control.controller[" in shown and ": serving on 127.0.0.1:" in shown, shown
    assert " INFO " not in run_cli("logs", "t-local", "--component", "driver", "--level", "ERROR").stdout


def test_second_up_with_same_name_is_refused(deployment):
    again = run_cli("up", str(deployment["config"]))
    assert again.returncode == 2
    assert "already running" in again.stderr and "Traceback" not in again.stderr
