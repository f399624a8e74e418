"""A site profile as data: what goes before each command and into each srun step. Pure functions.

Which processes are wrapped, and why that is enough:
- the driver (the batch script's last command): it imports Ray and must match the Ray and Python of
  the nodes exactly, so it runs in the same image;
- each node's Ray (`python -m hpcserve.raycluster.node`, one srun step per node, see
  raycluster/launch.py). Every Ray worker, hence every EngineHost actor and the vLLM process it
  starts, is a child of that node's raylet: they run inside the container without a wrapper of their
  own.

The driver calls srun from inside the container, so the image must have Slurm's client commands, or
the site binds them in (`hpcserve doctor` checks this before anything is submitted).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpcserve.core.config import DeploymentConfig, SiteSpec

# The environment variable through which the batch script tells the driver's SrunLauncher how to start
# each node's step; one JSON object, so it travels exactly through sbatch, srun and containers.
STEP_ENV = "HPCSERVE_SITE_STEP"
# The interpreter inside a container image: found on the image's PATH (a venv or conda env the image
# activates), since the login node's interpreter path means nothing there.
CONTAINER_PYTHON = "python3"
# Ray's per-node temp dirs (raycluster/cluster.py) live under /tmp: the driver and the node's raylet must
# see the same folder. Apptainer binds /tmp by default; enroot does not.
RAY_TEMP_PARENT = "/tmp"


@dataclass(frozen=True)
class StepWrap:
    """How one process is started on a node under the site's runtime."""

    srun_options: tuple[str, ...] = ()   # extra options of every srun step (pyxis)
    prefix: tuple[str, ...] = ()         # argv before the command (apptainer exec ... IMAGE)
    request_gpus: bool = True            # srun steps ask for their GPUs (--gpus-per-node) only with GRES

    def to_env(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> StepWrap:
        raw = environ.get(STEP_ENV)
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(tuple(data.get("srun_options", ())), tuple(data.get("prefix", ())),
                   bool(data.get("request_gpus", True)))

    @property
    def is_plain(self) -> bool:
        return self == StepWrap()


@dataclass(frozen=True)
class SiteProfile:
    """Everything the batch script needs from the site section."""

    runtime: str
    step: StepWrap                       # for every node's Ray
    driver: tuple[str, ...]              # argv before `PYTHON -m hpcserve.deployment.driver RUN_DIR`
    python: str | None                   # interpreter for the driver; None: the caller's
    exclusive: bool                      # ask for whole nodes (GPUs without GRES)
    mounts: tuple[str, ...] = field(default=())


def profile_for(cfg: DeploymentConfig, results_dir: Path) -> SiteProfile:
    site = cfg.site
    mounts = tuple(container_mounts(cfg, results_dir))
    request_gpus = site.gres
    exclusive = cfg.on_gpu and not site.gres and not has_option(cfg.cluster.sbatch_extra, "--exclusive")
    if site.runtime == "apptainer":
        prefix = tuple(apptainer_prefix(site, mounts, cfg.on_gpu))
        return SiteProfile("apptainer", StepWrap((), prefix, request_gpus), prefix, CONTAINER_PYTHON, exclusive, mounts)
    if site.runtime == "pyxis":
        options = tuple(pyxis_options(site, mounts))
        # The driver is a one-task step on this node; --overlap: the node steps it starts share the node.
        driver = ("srun", "--nodes=1", "--ntasks=1", "--overlap", "--export=ALL", *options)
        return SiteProfile("pyxis", StepWrap(options, (), request_gpus), driver, CONTAINER_PYTHON, exclusive, mounts)
    return SiteProfile("venv", StepWrap((), (), request_gpus), (), None, exclusive, ())


def container_mounts(cfg: DeploymentConfig, results_dir: Path) -> list[str]:
    """Paths every container needs: the results folder (run folder, logs, config), the model folder
    when it is a local path, then the site's own binds; in order, without repeats."""
    wanted = [str(results_dir)]
    model = cfg.model.path
    if model.startswith("/"):
        wanted.append(model.rstrip("/") or "/")
    wanted += cfg.site.binds
    seen: list[str] = []
    for path in wanted:
        if path not in seen:
            seen.append(path)
    return seen


def apptainer_prefix(site: SiteSpec, mounts: tuple[str, ...] | list[str], gpus: bool) -> list[str]:
    """`apptainer exec [--nv] [--bind a,b] IMAGE` (singularity takes the same options)."""
    if site.image is None:  # refused by the schema already
        raise ValueError("site.runtime 'apptainer' needs site.image: the container image to run")
    argv = [site.container_command, "exec"]
    if gpus:
        argv.append("--nv")  # the host's NVIDIA driver libraries and devices inside the container
    if mounts:
        argv += ["--bind", ",".join(mounts)]
    return argv + [site.image]


def pyxis_options(site: SiteSpec, mounts: tuple[str, ...] | list[str]) -> list[str]:
    """srun options of pyxis's SPANK plugin. Pyxis wants SRC:DST; a bare path is mounted at itself."""
    pairs = [m if ":" in m else f"{m}:{m}" for m in (*mounts, RAY_TEMP_PARENT)]
    options = [f"--container-image={site.image}"]
    if pairs:
        options.append("--container-mounts=" + ",".join(dict.fromkeys(pairs)))
    return options


def has_option(options: list[str], name: str) -> bool:
    return any(o == name or o.startswith(name + "=") for o in options)


def shell_words(argv: tuple[str, ...] | list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
