"""The model catalogue: names resolve to real shapes, agree with the published config.json files
in tests/data/models, plan without weights, and quantized variants shrink the weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcserve.core.config import ClusterSpec, Layout, parse_config
from hpcserve.core.errors import ConfigError
from hpcserve.planning import model_source
from hpcserve.planning import catalog
from hpcserve.planning.model_shape import (
    ModelShape,
    estimate_weights_bytes,
    total_params,
)
from hpcserve.planning.planner import GIB, check_config_layout, plan, plan_for_config
from hpcserve.planning.report import explain

MODELS = Path(__file__).parents[1] / "data" / "models"
A100_1x8 = ClusterSpec(scheduler="slurm", nodes=1, gpus_per_node=8, gpu_memory_gb=80)
H200_1x2 = ClusterSpec(scheduler="slurm", nodes=1, gpus_per_node=2, gpu_memory_gb=141)


def shape(name: str) -> ModelShape:
    return ModelShape.from_config(catalog.lookup(name).config)


def checkpoint(name: str) -> dict:
    return json.loads((MODELS / f"{name}.json").read_text())


@pytest.mark.parametrize(("name", "published_billions"), [
    ("llama-3.2-1b", 1.24), ("llama-3.2-3b", 3.21), ("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.6),
    ("llama-3.1-405b", 405.9), ("qwen2.5-7b", 7.62), ("qwen2.5-14b", 14.8), ("qwen2.5-32b", 32.8),
    ("qwen2.5-72b", 72.7), ("mistral-7b-v0.3", 7.25), ("mixtral-8x7b", 46.7), ("mixtral-8x22b", 141),
])
def test_parameter_counts_match_published_sizes(name, published_billions):
    assert total_params(shape(name)) / 1e9 == pytest.approx(published_billions, rel=0.01)


def test_falcon_shapes_follow_vllms_falcon_attention():
    f7, f40, f180 = shape("falcon-7b"), shape("falcon-40b"), shape("falcon-180b")
    assert (f7.num_heads, f7.num_kv_heads, f7.head_dim, f7.intermediate_size) == (71, 1, 64, 18176)  # multi-query
    assert (f40.num_heads, f40.num_kv_heads, f180.num_heads, f180.num_kv_heads) == (128, 8, 232, 8)
    assert not f7.gated_mlp and f7.tie_embeddings
    # Falcon-7B's checkpoint stores the tied LM head a second time: 7.22B as published
    assert (total_params(f7) + f7.vocab_size * f7.hidden_size) / 1e9 == pytest.approx(7.22, rel=0.01)
    assert total_params(f180) / 1e9 == pytest.approx(180, rel=0.01)


A100_2x8 = ClusterSpec(scheduler="slurm", nodes=2, gpus_per_node=8, gpu_memory_gb=80)


@pytest.mark.parametrize(("name", "cluster", "max_model_len", "expected"), [
    ("falcon-7b", A100_1x8, 2048, Layout(tensor=1, replicas=8)),        # 71 heads: tensor 1 only
    ("falcon-40b", A100_1x8, 2048, Layout(tensor=2, replicas=4)),
    ("falcon-180b", A100_2x8, 2048, Layout(tensor=8, replicas=2)),
    ("llama-3.1-405b", A100_2x8, 8192, Layout(tensor=8, pipeline=2, replicas=1)),
    ("llama-3.1-405b-fp8", A100_1x8, 8192, Layout(tensor=8, replicas=1)),
    ("mixtral-8x22b", A100_1x8, 16384, Layout(tensor=8, replicas=1)),
    ("qwen2.5-32b", A100_1x8, 32768, Layout(tensor=4, replicas=2)),
    ("llama-3.1-70b-awq", H200_1x2, 16384, Layout(tensor=1, replicas=2)),
])
def test_catalogue_models_plan_as_documented(name, cluster, max_model_len, expected):
    assert plan(shape(name), cluster, max_model_len=max_model_len).best_layout() == expected


def test_falcon_7b_rejects_tensor_parallel():
    p = plan(shape("falcon-7b"), A100_1x8, max_model_len=2048)
    assert "tensor 2 does not divide the 71 attention heads" in {c.layout.tensor: c.problems for c in p.rejected}[2]


def test_every_name_resolves_and_plans_on_some_cluster():
    big = ClusterSpec(scheduler="slurm", nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    for name in catalog.names():
        entry = catalog.lookup(name)
        p = plan(ModelShape.from_config(entry.config), big, max_model_len=min(entry.max_model_len, 8192))
        assert p.best is not None, (name, [c.problems for c in p.rejected])


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b", "qwen2.5-7b", "qwen2.5-72b",
                                  "mixtral-8x7b", "mixtral-8x22b", "falcon-7b"])
def test_catalogue_agrees_with_published_config_json(name):
    catalog.check_agreement(catalog.lookup(name), checkpoint(name))
    assert catalog.resolve_config(name, checkpoint(name)) == checkpoint(name)  # the checkpoint wins


def test_disagreement_is_one_error_naming_the_fields():
    with pytest.raises(ConfigError) as err:
        catalog.resolve_config("llama-3.1-70b", checkpoint("llama-3.1-8b"))
    message = str(err.value)
    assert "'model.catalog' = 'llama-3.1-70b' does not match the config.json in 'model.path'" in message
    assert "hidden_size 4096 (catalogue: 8192)" in message and "num_hidden_layers 32 (catalogue: 80)" in message


def test_vocab_and_context_may_differ_between_base_and_instruct():
    instruct = {**checkpoint("mixtral-8x22b"), "vocab_size": 32768, "max_position_embeddings": 65536}
    assert catalog.resolve_config("mixtral-8x22b", instruct) == instruct


def test_unknown_name_lists_close_names():
    with pytest.raises(ConfigError, match="did you mean llama-3.1-70b") as err:
        catalog.lookup("llama-3-70b")
    assert "`hpcserve plan --list-models`" in str(err.value)
    assert catalog.lookup("Llama-3.1-8B").name == "llama-3.1-8b"


def test_quantized_variants_are_the_base_shape_with_the_method():
    awq = catalog.lookup("llama-3.1-70b-awq")
    assert (awq.quantization, awq.dtype) == ("awq", "float16")
    assert estimate_weights_bytes(ModelShape.from_config(awq.config)) / GIB == pytest.approx(37.0, abs=0.5)
    assert estimate_weights_bytes(shape("llama-3.1-70b-fp8")) / GIB == pytest.approx(67.7, abs=0.5)
    assert estimate_weights_bytes(shape("llama-3.1-70b-gptq")) == estimate_weights_bytes(shape("llama-3.1-70b-awq"))
    assert plan(shape("llama-3.1-70b-awq"), H200_1x2, max_model_len=8192).best_layout() == Layout(tensor=1, replicas=2)
    assert plan(shape("llama-3.1-70b"), H200_1x2, max_model_len=8192).best_layout() == Layout(tensor=2, replicas=1)


def test_group_size_of_the_checkpoint_counts():
    base = checkpoint("llama-3.1-8b")
    sized = {g: estimate_weights_bytes(ModelShape.from_config({**base, "torch_dtype": "float16", "quantization_config":
                                                               {"quant_method": "gptq", "bits": 4, "group_size": g}}))
             for g in (32, 128, -1)}
    assert sized[32] > sized[128] > sized[-1]
    linear = total_params(ModelShape.from_config(base)) - 2 * 128256 * 4096 - 4096 * 65
    assert (sized[32] - sized[-1]) == pytest.approx(linear * (16 + 4) / 32 / 8, rel=0.001)  # scale + zero per 32


def test_variant_and_model_quantization_must_agree():
    with pytest.raises(ConfigError, match="is a awq variant but 'model.quantization' = 'gptq'"):
        catalog.resolve_config("llama-3.1-70b-awq", None, quantization="gptq")
    assert catalog.resolve_config("llama-3.1-70b-awq", None, quantization="awq")["quantization_config"]["bits"] == 4


def test_listing_has_one_line_per_base_model():
    lines = catalog.listing()
    assert len(lines) == 1 + len(catalog.BASE) + 1
    assert any(line.startswith("llama-3.1-70b ") and "70.6B" in line for line in lines)
    assert {e.family for e in catalog.BASE.values()} == {"Llama", "Qwen", "Mistral", "Mixtral", "Falcon"}


# ---------------------------------------------------------------- in a deployment file, without weights

def deployment(path: str, **model) -> dict:
    return {"name": "big", "model": {"path": path, "max_model_len": 8192, **model},
            "cluster": {"scheduler": "slurm", "nodes": 1, "gpus_per_node": 8, "gpu_memory_gb": 80}}


def test_catalogue_plans_when_the_weights_are_not_here(tmp_path):
    cfg = parse_config(deployment(str(tmp_path / "not-staged-yet"), catalog="llama-3.1-70b"))
    model_path = model_source.resolve_model_path(cfg)
    assert model_path == str(tmp_path / "not-staged-yet")
    model_config = model_source.model_config_for(cfg, model_path)
    assert model_config == catalog.lookup("llama-3.1-70b").config
    p = plan_for_config(cfg, model_config)
    assert p.best_layout() == Layout(tensor=4, replicas=2)  # as from the real config.json
    assert plan_for_config(cfg, None).best_layout() == Layout(tensor=4, replicas=2)
    text = "\n".join(explain(p))
    assert "Catalogue: llama-3.1-70b (the shape of meta-llama/Llama-3.1-70B-Instruct); read from the catalogue" in text
    assert "Recommended" not in text  # max_model_len is set, dtype auto
    raw = deployment(str(tmp_path), catalog="llama-3.1-70b-awq", dtype="bfloat16")
    del raw["model"]["max_model_len"]
    text = "\n".join(explain(plan_for_config(parse_config(raw), None)))
    assert "Recommended: model.max_model_len: 16384 (unset, vLLM takes the model's 131,072" in text
    assert "Recommended: model.dtype: float16 (vLLM's awq kernels take float16 activations, not bfloat16)" in text
    assert "Catalogue: llama-3.1-70b-awq (the shape of meta-llama/Llama-3.1-70B-Instruct, awq weights)" in text


def test_catalogue_checks_a_staged_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(checkpoint("llama-3.1-8b")))
    cfg = parse_config(deployment(str(tmp_path), catalog="llama-3.1-70b"))
    with pytest.raises(ConfigError, match="hidden_size 4096 \\(catalogue: 8192\\)"):
        model_source.model_config_for(cfg, model_source.resolve_model_path(cfg))
    with pytest.raises(ConfigError, match="does not match"):
        check_config_layout(cfg, checkpoint("llama-3.1-8b"), Layout(tensor=1, replicas=8))


def test_unknown_catalogue_name_is_reported_before_the_missing_folder(tmp_path):
    cfg = parse_config(deployment(str(tmp_path / "nowhere"), catalog="lama-3.1-70b"))
    with pytest.raises(ConfigError, match="did you mean llama-3.1-70b"):
        model_source.resolve_model_path(cfg)


def test_without_catalogue_a_missing_folder_is_still_an_error(tmp_path):
    cfg = parse_config(deployment(str(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match="no such folder"):
        model_source.resolve_model_path(cfg)
    with pytest.raises(ConfigError, match="or name the model in 'model.catalog'"):
        plan_for_config(cfg, None)


def test_local_serving_needs_the_weights_here(tmp_path):
    cfg = parse_config({**deployment(str(tmp_path / "later"), catalog="llama-3.2-1b"),
                        "cluster": {"scheduler": "local"}})
    with pytest.raises(ConfigError, match="Stage the weights there first"):
        model_source.check_weights_here(cfg, model_source.resolve_model_path(cfg))
