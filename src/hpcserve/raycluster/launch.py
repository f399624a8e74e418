"""How a process is started on a given node: directly (local mode) or through srun (inside a job).

Both return a Popen we own: the process (or the srun step) dies when we stop it, and its exit is how
we learn that a node's Ray failed to start, without waiting for a deadline.

Inside a job the site profile (site: in the config, see hpcserve.site) decides what surrounds the
command: srun options (pyxis's --container-image), a command in front (apptainer exec ... IMAGE), and
whether steps ask for GPUs (not without GRES). The batch script hands it over in $HPCSERVE_SITE_STEP,
so the script `hpcserve render` prints is the whole truth of how nodes are started.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Protocol

from hpcserve.core.osenv import PRIVATE_UMASK
from hpcserve.site.profiles import StepWrap


class NodeLauncher(Protocol):
    def launch(self, node: str, argv: list[str], log: Path, gpus: int = 0) -> subprocess.Popen: ...


def _popen(argv: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        # umask: srun hands it on to the step, so Ray's files on every node are ours alone
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=os.environ.copy(), umask=PRIVATE_UMASK)


class LocalLauncher:
    """Every 'node' is this machine."""

    def launch(self, node: str, argv: list[str], log: Path, gpus: int = 0) -> subprocess.Popen:
        return _popen(argv, log)


class SrunLauncher:
    """One srun step per node inside the current allocation, wrapped as the site profile says
    (by default the one the batch script exported)."""

    def __init__(self, step: StepWrap | None = None):
        self.step = step if step is not None else StepWrap.from_env(os.environ)

    def launch(self, node: str, argv: list[str], log: Path, gpus: int = 0) -> subprocess.Popen:
        return _popen(srun_argv(node, argv, gpus, self.step), log)


def srun_argv(node: str, argv: list[str], gpus: int = 0, step: StepWrap = StepWrap()) -> list[str]:
    # --overlap: the Ray node shares the node's CPUs with later steps; --kill-on-bad-exit=0: one node's
    # failure is reported by us with its name, not by Slurm killing every step; GPUs are requested
    # explicitly because a step does not inherit the job's GPUs (without GRES there are none to ask
    # for: the node's GPUs are all visible to every step).
    srun = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap", "--kill-on-bad-exit=0",
            "--export=ALL"]
    if gpus and step.request_gpus:
        srun.append(f"--gpus-per-node={gpus}")
    return srun + list(step.srun_options) + list(step.prefix) + argv
