"""A deployment's log files, by node and component, in its one results folder (an endpoint's members keep
their run folders inside its own)."""

from __future__ import annotations

from pathlib import Path

from hpcserve.core.errors import UsageError
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import load_record

COMPONENTS = {
    "driver": ["driver.log", "endpoint.log", "router.log"],
    "slurm": ["slurm.out", "job.sbatch"],
    "ray": ["nodes/*/ray-start.log", "nodes/*/launch.log", "nodes/*/ray/*.log", "nodes/*/ray/*.out"],
    "engine": ["engines/*.log"],
    "health": ["health.json", "nccl.*.log"],
    "monitor": ["monitor/*.jsonl"],
    "timeline": ["timeline.json", "state.json"],
}


def log_files(name: str, node: str | None = None, component: str | None = None) -> list[Path]:
    record = load_record(name)
    paths = RunPaths(Path(record.run_dir))
    if component and component not in COMPONENTS:
        raise UsageError(f"unknown component '{component}': choose one of {', '.join(COMPONENTS)}")
    patterns = COMPONENTS[component] if component else [p for ps in COMPONENTS.values() for p in ps]
    # An endpoint's members keep their run folders inside its own (members/logs/NAME-...).
    folders = [paths.root, *paths.member_run_dirs()]
    files = sorted({f for d in folders for p in patterns for f in d.glob(p) if f.is_file()})
    if node:
        files = [f for f in files if node in f.relative_to(paths.root).parts or node in f.name]
    return files
