"""How vLLM reads the weights: `engine.load_format: auto` takes the fastest loader that this node can run.

On a cluster the weights come from a parallel filesystem, and reading them dominates the start of a big
model. vLLM ships several loaders; which is fastest depends on the storage, so the order below is what
hpcserve measured (benchmarks/results/gpu.md), and a loader is only chosen when its package imports here
(the driver runs in the engines' environment: the same venv or container). vLLM on CPU reads with its
default loader. A user's own --load-format in engine.args always wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec

AUTO = "auto"
# Fastest first, measured (benchmarks/results/gpu.md, 2026-12-02: 16 GB of bf16 from a cold local disk to one
# H200, vLLM 0.26's own iterators: fastsafetensors 9.87 s, runai_streamer 9.94 s, instanttensor 10.57 s,
# vLLM's default 11.10 s); each with the package vLLM imports for it.
PREFERENCE: tuple[tuple[str, str], ...] = (
    ("fastsafetensors", "fastsafetensors"),
    ("runai_streamer", "runai_model_streamer"),
    ("instanttensor", "instanttensor"),
)


@dataclass(frozen=True)
class LoadChoice:
    load_format: str | None  # None: leave vLLM's default (no --load-format on the command line)
    reason: str


def installed(module: str) -> bool:
    return find_spec(module) is not None


def choose(setting: str, engine_args: list[str], on_gpu: bool,
           available: Callable[[str], bool] = installed) -> LoadChoice:
    """The --load-format for this deployment's engines, and why. Pure given `available`."""
    if any(arg == "--load-format" or arg.startswith("--load-format=") for arg in engine_args):
        return LoadChoice(None, "--load-format from engine.args")
    if setting != AUTO:
        return LoadChoice(setting, f"engine.load_format: {setting}")
    if not on_gpu:
        return LoadChoice(None, "vLLM's default loader (vLLM on CPU)")
    for load_format, module in PREFERENCE:
        if available(module):
            return LoadChoice(load_format, f"{load_format}, the fastest loader installed here")
    missing = ", ".join(module for _, module in PREFERENCE)
    return LoadChoice(None, f"vLLM's default loader (none of {missing} is installed)")


def load_format_args(choice: LoadChoice) -> list[str]:
    return ["--load-format", choice.load_format] if choice.load_format else []
