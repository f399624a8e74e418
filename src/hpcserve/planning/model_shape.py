"""A model's shape, read from its Hugging Face config.json, and what its weights and KV cache cost in bytes.

Pure functions, no torch. The byte counts follow how vLLM stores a decoder-only transformer:
q/k/v/o projections, a gated MLP (gate, up, down), Falcon's plain MLP (up, down) or a mixture of gated
experts, two norms per layer, input embedding and LM head (one matrix when tied). Biases are counted where
the config says they exist (Qwen2's qkv bias); everything else that is small (rotary caches, router of an
MoE, LayerNorm biases) is either counted exactly or below 0.1%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hpcserve.core.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
DTYPE_ALIASES = {"float": "float32", "half": "float16", "torch.float32": "float32",
                 "torch.float16": "float16", "torch.bfloat16": "bfloat16"}

# Bits a quantized linear weight takes, for methods vLLM accepts in --quantization or quantization_config.
QUANT_BITS = {"awq": 4, "awq_marlin": 4, "gptq": 4, "gptq_marlin": 4, "marlin": 4,
              "bitsandbytes": 4, "fp8": 8, "compressed-tensors": 8, "fbgemm_fp8": 8, "modelopt": 8}
# Group-wise integer methods store, per group of `group_size` input rows and per output column, one scale in
# the activation dtype (16 bits) and one zero point packed like the weights (`bits` bits). vLLM's
# AWQLinearMethod.create_weights (model_executor/layers/quantization/awq.py): qweight int32
# [in, out / (32/bits)], qzeros int32 [in / group, out / (32/bits)], scales fp16 [in / group, out]; GPTQ
# (gptq.py) the same with qweight packed along `in`, plus g_idx int32 [in] (32 / out bits per weight: below
# 0.01 bits). The Marlin repack (awq_marlin, gptq_marlin) keeps the sizes. AWQ/GPTQ int4, group 128:
# 4 + 20/128 = 4.16 bits per weight. FP8 (fp8, fbgemm_fp8, compressed-tensors w8a8): one byte per weight
# plus a per-tensor or per-channel fp32 scale (below 0.01 bits).
GROUP_METHODS = {"awq", "awq_marlin", "gptq", "gptq_marlin", "marlin"}
DEFAULT_GROUP_SIZE = 128
SCALE_BITS = 16
VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of 64 before splitting it over tensor ranks


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that decide memory and parallelism."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    dtype: str = "float32"          # the checkpoint's dtype (config torch_dtype / dtype)
    max_position_embeddings: int | None = None
    qkv_bias: bool = False
    quant_method: str | None = None  # from quantization_config
    quant_bits: int | None = None
    quant_group_size: int | None = None
    num_experts: int = 0            # 0: dense MLP
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    model_type: str = ""
    gated_mlp: bool = True          # False: Falcon's up/down MLP (2 matrices), not gate/up/down (3)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """Read a config.json dict (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE/Qwen3-MoE style, Falcon)."""
        config = {**config.get("text_config", {}), **config}  # multimodal wrappers keep the LM in text_config
        if config.get("model_type") == "falcon":
            config = _falcon_fields(config)
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in config]
        if missing:
            raise ConfigError(f"model config.json lacks {', '.join(missing)}: the planner needs a decoder-only "
                              "transformer config (Llama, Mistral, Qwen2, Mixtral style)")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        quant = config.get("quantization_config") or {}
        num_experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
        moe_inter = int(config.get("moe_intermediate_size") or (config.get("intermediate_size") if num_experts else 0) or 0)
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            vocab_size=int(config["vocab_size"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype=normalize_dtype(config.get("torch_dtype") or config.get("dtype") or "float32"),
            max_position_embeddings=config.get("max_position_embeddings"),
            qkv_bias=bool(config.get("attention_bias") or config.get("model_type") in ("qwen2", "qwen2_moe")),
            quant_method=quant.get("quant_method"),
            quant_bits=_quant_bits_from_config(quant),
            quant_group_size=_group_size_from_config(quant),
            num_experts=num_experts,
            experts_per_token=int(config.get("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=moe_inter,
            shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
            model_type=str(config.get("model_type", "")),
            gated_mlp=config.get("model_type") != "falcon",
        )


def _falcon_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Falcon's config in Llama's terms. KV heads as vLLM's FalconAttention reads them: num_kv_heads with
    new_decoder_architecture (40B, 180B), else 1 with multi_query (7B), else one per attention head. The MLP
    is up/down of ffn_hidden_size (default 4 x hidden). Old RW configs name fields n_layer, n_head, n_head_kv;
    the embeddings are tied unless the config says otherwise."""
    c = {**config}
    for old, new in (("n_layer", "num_hidden_layers"), ("n_head", "num_attention_heads"), ("n_embed", "hidden_size")):
        c.setdefault(new, config.get(old))
    heads = c.get("num_attention_heads")
    if c.get("new_decoder_architecture"):
        kv = c.get("num_kv_heads") or c.get("n_head_kv") or heads
    else:
        kv = 1 if c.get("multi_query", True) else heads
    c["num_key_value_heads"] = kv
    c["intermediate_size"] = c.get("ffn_hidden_size") or 4 * int(c.get("hidden_size") or 0)
    c.setdefault("tie_word_embeddings", True)
    c["attention_bias"] = bool(c.get("bias", False))
    return {k: v for k, v in c.items() if v is not None}


def normalize_dtype(dtype: str) -> str:
    name = DTYPE_ALIASES.get(str(dtype), str(dtype))
    if name not in DTYPE_BYTES:
        raise ConfigError(f"dtype {dtype!r} is not known; use one of {', '.join(DTYPE_BYTES)}")
    return name


def resolve_dtype(shape: ModelShape, dtype: str = "auto") -> str:
    """The dtype vLLM will run: 'auto' is the checkpoint's, except float32 checkpoints run in bfloat16
    (vLLM's rule for 'auto'). An explicit dtype wins."""
    if dtype == "auto":
        return "bfloat16" if shape.dtype == "float32" else shape.dtype
    return normalize_dtype(dtype)


def _group_size_from_config(quant: dict[str, Any]) -> int | None:
    size = quant.get("group_size", quant.get("q_group_size"))
    return int(size) if size else None


def _quant_bits_from_config(quant: dict[str, Any]) -> int | None:
    if not quant:
        return None
    if "bits" in quant:
        return int(quant["bits"])
    if "w_bit" in quant:  # AutoAWQ's quant_config.json name
        return int(quant["w_bit"])
    if quant.get("load_in_4bit"):
        return 4
    if quant.get("load_in_8bit"):
        return 8
    for group in (quant.get("config_groups") or {}).values():  # compressed-tensors
        bits = (group.get("weights") or {}).get("num_bits")
        if bits:
            return int(bits)
    return None


# ---------------------------------------------------------------- parameter counts

def attention_params(shape: ModelShape) -> int:
    q = shape.hidden_size * shape.num_heads * shape.head_dim
    kv = 2 * shape.hidden_size * shape.num_kv_heads * shape.head_dim
    bias = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim if shape.qkv_bias else 0
    return q + kv + q + bias  # o_proj has the shape of q_proj


def mlp_params(shape: ModelShape) -> int:
    """Gated MLP (3 matrices), or all experts + router + shared expert for MoE."""
    h = shape.hidden_size
    if not shape.is_moe:
        return (3 if shape.gated_mlp else 2) * h * shape.intermediate_size
    experts = shape.num_experts * 3 * h * shape.moe_intermediate_size
    shared = 3 * h * shape.shared_expert_intermediate_size + (h if shape.shared_expert_intermediate_size else 0)
    return experts + h * shape.num_experts + shared


def layer_params(shape: ModelShape) -> int:
    return attention_params(shape) + mlp_params(shape) + 2 * shape.hidden_size


def embedding_params(shape: ModelShape) -> int:
    """Input embedding plus LM head (one matrix when tied) plus the final norm."""
    matrices = 1 if shape.tie_embeddings else 2
    return matrices * shape.vocab_size * shape.hidden_size + shape.hidden_size


def total_params(shape: ModelShape) -> int:
    return shape.num_layers * layer_params(shape) + embedding_params(shape)


# ---------------------------------------------------------------- bytes

def quant_bits(shape: ModelShape, quantization: str | None) -> float | None:
    """Bits per linear-layer weight under a quantization method (None: not quantized)."""
    method = quantization or shape.quant_method
    if not method:
        return None
    if method not in QUANT_BITS:
        raise ConfigError(f"quantization {method!r} is not known to the planner; known: {', '.join(sorted(QUANT_BITS))}")
    from_checkpoint = method == shape.quant_method
    bits = shape.quant_bits if (shape.quant_bits and from_checkpoint) else QUANT_BITS[method]
    if method not in GROUP_METHODS:
        return bits
    group = (shape.quant_group_size if from_checkpoint else None) or DEFAULT_GROUP_SIZE
    if group <= 0:  # GPTQ's group_size -1: one group per column, scales and zeros negligible
        return bits
    return bits + (SCALE_BITS + bits) / group


def linear_weight_bytes(shape: ModelShape, params: int, dtype: str, quantization: str | None) -> float:
    bits = quant_bits(shape, quantization)
    return params * (bits / 8 if bits else DTYPE_BYTES[dtype])


def estimate_weights_bytes(shape: ModelShape, dtype: str = "auto", quantization: str | None = None) -> int:
    """Bytes of all weights. Quantization (argument, else the config's quantization_config) shrinks the
    linear layers of the blocks; embeddings, LM head and norms stay in the model dtype."""
    dtype = resolve_dtype(shape, dtype)
    norms = 2 * shape.hidden_size * shape.num_layers
    linear = shape.num_layers * layer_params(shape) - norms
    rest = embedding_params(shape) + norms
    return int(linear_weight_bytes(shape, linear, dtype, quantization) + rest * DTYPE_BYTES[dtype])


def kv_bytes_per_token(shape: ModelShape, dtype: str = "auto", kv_cache_dtype: str = "auto") -> int:
    """KV-cache bytes one token takes in the whole model: K and V, every layer, every KV head."""
    kv_dtype = resolve_dtype(shape, dtype) if kv_cache_dtype == "auto" else normalize_dtype(kv_cache_dtype)
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[kv_dtype]


# ---------------------------------------------------------------- per worker of a tensor x pipeline replica

def padded_vocab(shape: ModelShape) -> int:
    return math.ceil(shape.vocab_size / VOCAB_PADDING) * VOCAB_PADDING


def weights_bytes_per_worker(shape: ModelShape, tensor: int, pipeline: int, dtype: str, quantization: str | None) -> int:
    """Weights on the heaviest worker: ceil(layers / pipeline) layers split over tensor ranks (KV heads
    replicated when tensor > KV heads), plus the embedding or LM head (vocab-parallel). dtype: resolved."""
    h, kv_proj = shape.hidden_size, 2 * shape.hidden_size * shape.num_kv_heads * shape.head_dim
    kv_heads_here = math.ceil(shape.num_kv_heads / tensor)
    layer_linear = (attention_params(shape) - kv_proj + mlp_params(shape)) / tensor + 2 * h * kv_heads_here * shape.head_dim
    layers = math.ceil(shape.num_layers / pipeline)
    matrices = (1 if shape.tie_embeddings else 2) if pipeline == 1 else 1  # the heaviest stage holds one
    dense = layers * 2 * h + matrices * padded_vocab(shape) * h / tensor + h
    return int(linear_weight_bytes(shape, int(layers * layer_linear), dtype, quantization) + dense * DTYPE_BYTES[dtype])


def kv_bytes_per_token_per_worker(shape: ModelShape, tensor: int, pipeline: int, dtype: str = "auto",
                                  kv_cache_dtype: str = "auto") -> int:
    """KV bytes of one token on one worker: its stage's layers, its share of KV heads (at least one)."""
    per_layer_head = kv_bytes_per_token(shape, dtype, kv_cache_dtype) // (shape.num_layers * shape.num_kv_heads)
    return per_layer_head * math.ceil(shape.num_layers / pipeline) * math.ceil(shape.num_kv_heads / tensor)
