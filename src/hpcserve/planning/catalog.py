"""The model catalogue: `model.catalog: llama-3.1-70b` names a model's shape and recommended settings without
its config.json, so `hpcserve plan` and `parallelism: auto` work before the weights are staged (or when they
exist only on the compute nodes). `model.path` still names the weights; nothing is downloaded.

Shapes are the published config.json values (Hugging Face model repositories named in `hf_id`); the ones in
tests/data/models are checked against these. Quantized variants are a base name plus `-awq`, `-gptq` or
`-fp8`: the base shape with the method's quantization_config, exactly as `model.quantization` on the base
name would plan it (one mechanism, two spellings; see docs/planner.md). A variant says nothing about whether
such a checkpoint is published.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from hpcserve.core.config import DeploymentConfig
from hpcserve.core.errors import ConfigError
from hpcserve.planning.model_shape import (
    ModelShape,
    estimate_weights_bytes,
    total_params,
)


@dataclass(frozen=True)
class Entry:
    name: str
    hf_id: str
    config: dict[str, Any]            # config.json fields the planner reads
    max_model_len: int                # recommended context: a starting point, see `note`
    dtype: str = "bfloat16"
    quantization: str | None = None   # set on -awq/-gptq/-fp8 variants
    note: str = ""
    family: str = field(default="", compare=False)


def _dense(model_type: str, hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, max_pos: int,
           tie: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": inter, "vocab_size": vocab, "max_position_embeddings": max_pos,
            "tie_word_embeddings": tie, "torch_dtype": "bfloat16", **extra}


def _falcon(hidden: int, layers: int, heads: int, kv: int | None) -> dict[str, Any]:
    new_arch = kv is not None
    config = {"model_type": "falcon", "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
              "new_decoder_architecture": new_arch, "multi_query": not new_arch, "vocab_size": 65024, "bias": False,
              "parallel_attn": True, "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}
    return {**config, "num_kv_heads": kv} if new_arch else config


LLAMA3_VOCAB, QWEN_VOCAB = 128256, 152064
_BASE = [
    # name, Hugging Face id, config, recommended max_model_len, note
    ("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct",
     _dense("llama", 2048, 16, 32, 8, 8192, LLAMA3_VOCAB, 131072, tie=True, head_dim=64), 32768, ""),
    ("llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct",
     _dense("llama", 3072, 28, 24, 8, 8192, LLAMA3_VOCAB, 131072, tie=True, head_dim=128), 32768, ""),
    ("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct",
     _dense("llama", 4096, 32, 32, 8, 14336, LLAMA3_VOCAB, 131072), 32768, ""),
    ("llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct",
     _dense("llama", 8192, 80, 64, 8, 28672, LLAMA3_VOCAB, 131072), 16384,
     "131072 is supported but holds few sequences per replica"),
    ("llama-3.1-405b", "meta-llama/Llama-3.1-405B-Instruct",
     _dense("llama", 16384, 126, 128, 8, 53248, LLAMA3_VOCAB, 131072), 8192,
     "810 GB in bf16: two nodes of 8 x 80 GB with pipeline 2, or the -fp8 variant on one node"),
    ("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct",
     _dense("qwen2", 3584, 28, 28, 4, 18944, QWEN_VOCAB, 32768), 32768,
     "28 heads: tensor 8 is impossible; base configs say 131072 (YaRN), 32768 is native"),
    ("qwen2.5-14b", "Qwen/Qwen2.5-14B-Instruct",
     _dense("qwen2", 5120, 48, 40, 8, 13824, QWEN_VOCAB, 32768), 32768, "40 heads: tensor 8 is impossible"),
    ("qwen2.5-32b", "Qwen/Qwen2.5-32B-Instruct",
     _dense("qwen2", 5120, 64, 40, 8, 27648, QWEN_VOCAB, 32768), 32768, "40 heads: tensor 8 is impossible"),
    ("qwen2.5-72b", "Qwen/Qwen2.5-72B-Instruct",
     _dense("qwen2", 8192, 80, 64, 8, 29568, QWEN_VOCAB, 32768), 16384, ""),
    ("mistral-7b-v0.3", "mistralai/Mistral-7B-Instruct-v0.3",
     _dense("mistral", 4096, 32, 32, 8, 14336, 32768, 32768), 32768, ""),
    ("mixtral-8x7b", "mistralai/Mixtral-8x7B-Instruct-v0.1",
     _dense("mixtral", 4096, 32, 32, 8, 14336, 32000, 32768, num_local_experts=8, num_experts_per_tok=2), 32768,
     "46.7B parameters, 12.9B active per token"),
    ("mixtral-8x22b", "mistralai/Mixtral-8x22B-v0.1",
     _dense("mixtral", 6144, 56, 48, 8, 16384, 32000, 65536, num_local_experts=8, num_experts_per_tok=2), 16384,
     "141B parameters, 39B active; the Instruct checkpoint has vocab 32768"),
    ("falcon-7b", "tiiuae/falcon-7b-instruct", _falcon(4544, 32, 71, None), 2048,
     "71 heads and one KV head (multi-query): tensor 1 only"),
    ("falcon-40b", "tiiuae/falcon-40b-instruct", _falcon(8192, 60, 128, 8), 2048, ""),
    ("falcon-180b", "tiiuae/falcon-180B-chat", _falcon(14848, 80, 232, 8), 2048,
     "232 heads: tensor 8 (29 heads each) works, tensor 16 does not"),
]
FAMILIES = {"llama": "Llama", "qwen2": "Qwen", "mistral": "Mistral", "mixtral": "Mixtral", "falcon": "Falcon"}
BASE = {name: Entry(name, hf, config, max_len, note=note, family=FAMILIES[config["model_type"]])
        for name, hf, config, max_len, note in _BASE}

# Variants: the method's quantization_config as such checkpoints carry it. AWQ and GPTQ kernels in vLLM take
# float16 activations (AWQConfig.get_supported_act_dtypes: [torch.half]), hence dtype float16 there.
VARIANTS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, "float16"),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "float16"),
    "fp8": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "bfloat16"),
}

# Fields that must agree between the catalogue and a config.json found in model.path: the architecture.
# vocab_size and max_position_embeddings may differ between base and instruct checkpoints of one model
# (Mixtral-8x22B 32000/32768, Qwen2.5 131072/32768); there the checkpoint wins, since vLLM loads it.
ARCHITECTURE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                       "intermediate_size", "num_local_experts")


def names(include_variants: bool = True) -> list[str]:
    base = sorted(BASE)
    return base + [f"{b}-{v}" for b in base for v in VARIANTS] if include_variants else base


def lookup(name: str) -> Entry:
    """The entry for a catalogue name (case-insensitive), or ConfigError naming the closest ones."""
    key = name.strip().lower()
    if key in BASE:
        return BASE[key]
    base, _, method = key.rpartition("-")
    if base in BASE and method in VARIANTS:
        quant, dtype = VARIANTS[method]
        entry = BASE[base]
        return Entry(key, entry.hf_id, {**entry.config, "torch_dtype": dtype, "quantization_config": quant},
                     entry.max_model_len, dtype, method, entry.note, entry.family)
    close = difflib.get_close_matches(key, names(), n=4, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ConfigError(f"'model.catalog' = {name!r} is not in the catalogue; {hint}"
                      f"`hpcserve plan --list-models` lists all {len(names())} names")


def resolve_config(catalog: str | None, model_config: dict[str, Any] | None,
                   quantization: str | None = None) -> dict[str, Any] | None:
    """The config.json the planner should read: the checkpoint's when there is one (checked against the
    catalogue), else the catalogue's. Without a catalogue name: the checkpoint's, possibly None."""
    if catalog is None:
        return model_config
    entry = lookup(catalog)
    if entry.quantization and quantization and quantization != entry.quantization:
        raise ConfigError(f"'model.catalog' = {catalog!r} is a {entry.quantization} variant but 'model.quantization' "
                          f"= {quantization!r}: drop one of them")
    if model_config is None:
        return dict(entry.config)
    check_agreement(entry, model_config)
    return model_config


def check_agreement(entry: Entry, model_config: dict[str, Any]) -> None:
    """ConfigError listing every architecture field where the checkpoint's config.json and the catalogue differ."""
    ours, theirs = ModelShape.from_config(entry.config), ModelShape.from_config(model_config)
    pairs = {"hidden_size": (ours.hidden_size, theirs.hidden_size), "num_hidden_layers": (ours.num_layers, theirs.num_layers),
             "num_attention_heads": (ours.num_heads, theirs.num_heads),
             "num_key_value_heads": (ours.num_kv_heads, theirs.num_kv_heads),
             "intermediate_size": (ours.intermediate_size, theirs.intermediate_size),
             "num_local_experts": (ours.num_experts, theirs.num_experts)}
    diffs = [f"{k} {theirs_v} (catalogue: {ours_v})" for k, (ours_v, theirs_v) in pairs.items() if ours_v != theirs_v]
    if diffs:
        raise ConfigError(f"'model.catalog' = {entry.name!r} does not match the config.json in 'model.path': "
                          f"{', '.join(diffs)}. Fix model.catalog (or drop it: the checkpoint's config.json is "
                          "enough when it is there)")


def listing() -> list[str]:
    """One line per base model for `hpcserve plan --list-models`: shape, size and recommended settings."""
    lines = [(f"{'name':<17} {'params':>7} {'bf16':>8}  {'layers':>6} {'hidden':>6} {'heads':>5} {'kv':>3} "
              f"{'context':>7} {'recommended':>11}  Hugging Face id")]
    for name in names(include_variants=False):
        e, shape = BASE[name], ModelShape.from_config(BASE[name].config)
        lines.append(f"{name:<17} {total_params(shape) / 1e9:6.1f}B {estimate_weights_bytes(shape) / 2**30:6.0f}Gi  "
                     f"{shape.num_layers:>6} {shape.hidden_size:>6} {shape.num_heads:>5} {shape.num_kv_heads:>3} "
                     f"{shape.max_position_embeddings:>7} {e.max_model_len:>11}  {e.hf_id}")
    lines.append(f"Quantized variants: append {', '.join('-' + v for v in VARIANTS)} to a name "
                 "(e.g. llama-3.1-70b-awq): 4-bit AWQ/GPTQ (group 128, float16) or 8-bit FP8 weights.")
    return lines


def catalog_notes(cfg: DeploymentConfig, model_config: dict[str, Any] | None) -> list[str]:
    """Where the shape came from when model.catalog is set, and the catalogue's recommended settings that
    the deployment file does not set yet."""
    name = cfg.model.catalog
    if not name:
        return []
    entry = lookup(name)
    from_catalogue = model_config is None or model_config == entry.config  # model_source.model_config_for filled it in
    source = "the catalogue (no config.json in model.path here)" if from_catalogue else \
        "the config.json in model.path (it matches)"
    weights = f", {entry.quantization} weights" if entry.quantization else ""
    lines = [f"Catalogue: {entry.name} (the shape of {entry.hf_id}{weights}); read from {source}"
             + (f"; {entry.note}" if entry.note else "")]
    if cfg.model.max_model_len is None:
        lines.append(f"Recommended: model.max_model_len: {entry.max_model_len} (unset, vLLM takes the model's "
                     f"{entry.config['max_position_embeddings']:,} and the plan above does too)")
    if entry.quantization in ("awq", "gptq") and cfg.model.dtype not in ("auto", entry.dtype):
        lines.append(f"Recommended: model.dtype: {entry.dtype} (vLLM's {entry.quantization} kernels take float16 "
                     f"activations, not {cfg.model.dtype})")
    return lines
