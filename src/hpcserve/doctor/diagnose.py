"""Run the doctor: the commands a login node can run (Slurm's clients, one probe step on the compute
nodes), each through one swappable runner, and the pure checks over what they printed.

Nothing is submitted: the batch script is only tested (`sbatch --test-only`), and the probe is a short
srun step that gives up when no node is free within a minute.
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from hpcserve.core.config import BUILTIN_TINY, DeploymentConfig, Layout
from hpcserve.core.errors import HpcserveError, UnsafePathError
from hpcserve.core.folders import others_can_write, private_dir
from hpcserve.deployment.preflight import RESULTS_FIX
from hpcserve.doctor.checks import (
    SINFO_FORMAT,
    Captured,
    check_accounting,
    check_commands,
    check_controller,
    check_partition,
    check_submission,
    check_time,
)
from hpcserve.doctor.findings import Finding, blocker, info, ok, warning
from hpcserve.doctor.probe import IMMEDIATE_S, check_probe, probe_argv
from hpcserve.planning.model_source import resolve_model_path, weight_bytes
from hpcserve.site.profiles import SiteProfile, profile_for
from hpcserve.slurm.render import render_batch_script

Runner = Callable[[list[str], float], Captured]
PROBE_TIMEOUT_S = IMMEDIATE_S + 240.0  # waiting for nodes, then importing vLLM on a slow node


def run_command(argv: list[str], timeout_s: float) -> Captured:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                              check=False)
    except FileNotFoundError:
        return Captured(tuple(argv), 127, "", f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return Captured(tuple(argv), None, out, "")
    return Captured(tuple(argv), done.returncode, done.stdout, done.stderr)


def run_doctor(cfg: DeploymentConfig, python: str = sys.executable, runner: Runner = run_command,
               which: Callable[[str], str | None] = shutil.which) -> list[Finding]:
    """Every finding for this config on this site, blockers first."""
    results = Path(cfg.results_dir).resolve()
    profile = profile_for(cfg, results)
    findings: list[Finding] = make_results_folder(results)
    model_path, model_findings = locate_model(cfg)
    findings += model_findings
    findings += check_image(cfg)
    if cfg.cluster.scheduler == "local":
        findings += check_time(cfg, weight_bytes(model_path))
        findings += [info("scheduler", "scheduler 'local': Slurm checks skipped; this machine is probed")]
        if cfg.site.runtime != "venv":
            findings.append(blocker("container", f"site.runtime '{cfg.site.runtime}' applies to Slurm jobs only: "
                                    "scheduler 'local' would run outside the container",
                                    "set cluster.scheduler: slurm, or site.runtime: venv"))
        findings += run_probe_here(cfg, profile, python, model_path, runner)
        return ordered(findings)
    found = {c: which(c) for c in ("sbatch", "squeue", "sinfo", "srun", "scontrol")}
    findings += check_commands(found)
    if not all(found.values()):
        return ordered(findings + check_time(cfg, weight_bytes(model_path)))
    squeue = runner(["squeue", "-h", "-u", getpass.getuser(), "-o", "%i"], 30)
    findings += check_controller(squeue)
    if squeue.rc != 0:
        return ordered(findings + check_time(cfg, weight_bytes(model_path)))
    findings += check_partition(cfg, runner(["sinfo", "-h", "-o", SINFO_FORMAT], 30))
    findings += check_accounting(cfg, accounting(cfg, runner), enforce_setting(runner))
    test_only = test_submission(cfg, python, results, runner)
    findings += check_submission(test_only)
    findings += check_time(cfg, weight_bytes(model_path), test_only, time.time())
    probe = runner(probe_argv(cfg, profile, python, model_path, serve_ports(cfg), str(results / "logs")),
                   PROBE_TIMEOUT_S)
    findings += check_probe(cfg, profile, probe, model_path)
    return ordered(findings)


def make_results_folder(results: Path) -> list[Finding]:
    """`up` creates RESULTS/logs before submitting (Slurm does not create its output folder); so does
    the doctor, so that the nodes' view of it can be checked and containers can bind it."""
    shared = others_can_write(results)
    if shared:
        folder, problem = shared
        return [blocker("results", f"{folder} {problem}: others could plant the files hpcserve runs", RESULTS_FIX)]
    try:
        private_dir(results / "logs")
    except UnsafePathError as exc:
        return [blocker("results", str(exc), RESULTS_FIX)]
    except OSError as exc:
        return [blocker("results", f"cannot create {results / 'logs'}: {exc.strerror}",
                        "set results_dir to a folder you can write on the shared filesystem")]
    return []


def ordered(findings: list[Finding]) -> list[Finding]:
    rank = {"blocker": 0, "warning": 1, "info": 2, "ok": 3}
    return sorted(findings, key=lambda f: rank[f.severity.value])


def locate_model(cfg: DeploymentConfig) -> tuple[str | None, list[Finding]]:
    """The model folder the job would load (None for a hub id), as the login node sees it."""
    try:
        path = resolve_model_path(cfg)
    except HpcserveError as exc:
        return None, [blocker("model", str(exc), "fix model.path")]
    if not Path(path).is_dir():
        return None, [warning("model", f"model.path {path!r} is a hub id: compute nodes often have no internet",
                              "download it once to a shared folder (`huggingface-cli download` on a login node) "
                              "and set model.path to that folder")]
    if cfg.model.path == BUILTIN_TINY:
        return path, [info("model", f"{BUILTIN_TINY} is built at {path}: compute nodes must see that folder")]
    return path, []


def check_image(cfg: DeploymentConfig) -> list[Finding]:
    site = cfg.site
    if site.runtime == "venv":
        return []
    image = site.image or ""
    if image.startswith("/") and not os.access(image, os.R_OK):
        return [blocker("container", f"site.image {image} is not readable from here",
                        "build or copy the image to a shared folder and point site.image at it")]
    if site.runtime == "apptainer" and not shutil.which(site.container_command):
        return [info("container", f"{site.container_command} is not on this node's PATH; the probe checks the "
                     "compute nodes", "")]
    return [ok("container", f"{site.runtime} image {image}")]


def serve_ports(cfg: DeploymentConfig) -> list[int]:
    replicas = cfg.parallelism.replicas if isinstance(cfg.parallelism, Layout) else 1
    count = 1 if cfg.serve.router else replicas
    return [cfg.serve.port + i for i in range(count)]


def accounting(cfg: DeploymentConfig, runner: Runner) -> Captured:
    if not cfg.cluster.account and not cfg.cluster.qos:
        return Captured((), 0)
    return runner(["sacctmgr", "-n", "-P", "show", "assoc", f"user={getpass.getuser()}",
                   "format=account,partition,qos"], 30)


def enforce_setting(runner: Runner) -> str:
    done = runner(["scontrol", "show", "config"], 30)
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "AccountingStorageEnforce":
            return value.strip()
    return ""


def test_submission(cfg: DeploymentConfig, python: str, results: Path, runner: Runner) -> Captured:
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    try:
        script = render_batch_script(cfg, text, python, results)
    except HpcserveError as exc:
        return Captured(("render",), 1, "", str(exc))
    with tempfile.TemporaryDirectory(prefix="hpcserve-doctor-") as folder:
        path = Path(folder) / "job.sbatch"
        path.write_text(script)
        return runner(["sbatch", "--test-only", str(path)], 60)


def run_probe_here(cfg: DeploymentConfig, profile: SiteProfile, python: str, model_path: str | None,
                   runner: Runner) -> list[Finding]:
    """Local scheduler: the same probe, on this machine."""
    argv = probe_argv(cfg, profile, python, model_path, serve_ports(cfg), str(Path(cfg.results_dir).resolve() / "logs"))
    probe = runner(argv[argv.index("bash"):], PROBE_TIMEOUT_S)
    return check_probe(cfg, profile, probe, model_path)
