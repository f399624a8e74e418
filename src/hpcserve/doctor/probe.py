"""The compute-node probe: one srun step, one task per node, running the site's setup and then the
interpreter the job would use (inside the container, for container sites). It reports, per node, what
only a compute node can tell: is the model folder readable there, do Ray, vLLM and hpcserve import in
that environment, is the serving port free, is srun reachable from inside the container.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hpcserve.core.config import DeploymentConfig
from hpcserve.doctor.checks import Captured
from hpcserve.doctor.findings import Finding, blocker, ok, warning
from hpcserve.site.profiles import SiteProfile

MARKER = "HPCSERVE-DOCTOR "
PROBE_TIME = "5"            # minutes: the probe's own time limit
IMMEDIATE_S = 60            # give up when the nodes are not free within this (busy cluster)

# Runs on the node with the job's interpreter; stdlib only until it tries the imports it checks.
PROBE_CODE = r'''
import json, os, shutil, socket, sys
model, host, ports, logs = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3].split(",") if p], sys.argv[4]
out = {"host": socket.gethostname(), "python": sys.executable, "python_version": sys.version.split()[0],
       "logs_writable": os.path.isdir(logs) and os.access(logs, os.W_OK | os.X_OK)}
if model:
    try:
        with open(os.path.join(model, "config.json"), "rb") as handle:
            handle.read(1)
        out["model_error"] = None
    except OSError as exc:
        out["model_error"] = f"{type(exc).__name__}: {exc}"
busy = []
for port in ports:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        busy.append(port)
    finally:
        sock.close()
out["busy_ports"] = busy
out["srun"] = shutil.which("srun")
for name in ("hpcserve", "ray", "vllm"):
    try:
        out[name] = getattr(__import__(name), "__version__", "?")
    except BaseException as exc:
        out[name] = None
        out[name + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
print("HPCSERVE-DOCTOR " + json.dumps(out), flush=True)
'''


def probe_argv(cfg: DeploymentConfig, profile: SiteProfile, python: str, model_path: str | None,
               ports: list[int], logs_dir: str) -> list[str]:
    """srun ... bash -c 'SETUP; exec "$@"' doctor [WRAPPER] PYTHON -c PROBE MODEL HOST PORTS LOGS"""
    cluster = cfg.cluster
    srun = ["srun", f"--nodes={cluster.nodes}", "--ntasks-per-node=1", "--cpus-per-task=1", f"--time={PROBE_TIME}",
            f"--immediate={IMMEDIATE_S}", "--job-name=hpcserve-doctor", "--export=ALL"]
    srun += [f"--{k}={v}" for k, v in (("partition", cluster.partition), ("account", cluster.account),
                                       ("qos", cluster.qos)) if v]
    srun += list(profile.step.srun_options)
    # With pyxis the whole step is in the container; the site's setup lines belong to the host shell.
    setup = [] if profile.runtime == "pyxis" else list(cluster.setup)
    script = "\n".join(["set +eu", *setup, 'exec "$@"'])
    host = "0.0.0.0" if cfg.serve.host not in ("127.0.0.1", "localhost") else cfg.serve.host
    command = [*profile.step.prefix, profile.python or python, "-c", PROBE_CODE, model_path or "", host,
               ",".join(str(p) for p in ports), logs_dir]
    return srun + ["bash", "-c", script, "hpcserve-doctor", *command]


@dataclass(frozen=True)
class NodeReport:
    host: str
    data: dict

    def get(self, key: str):
        return self.data.get(key)


def parse_probe(stdout: str) -> list[NodeReport]:
    reports = []
    for line in stdout.splitlines():
        if line.startswith(MARKER):
            try:
                data = json.loads(line[len(MARKER):])
            except ValueError:
                continue
            reports.append(NodeReport(data.get("host", "?"), data))
    return reports


def check_probe(cfg: DeploymentConfig, profile: SiteProfile, probe: Captured, model_path: str | None) -> list[Finding]:
    """Findings from the probe's output. Pure."""
    reports = parse_probe(probe.stdout)
    if not reports:
        return [probe_failed(profile, probe)]
    findings: list[Finding] = []
    where = "the image" if profile.runtime != "venv" else "the environment cluster.setup activates"
    for name in ("hpcserve", "ray", "vllm"):
        bad = [r for r in reports if r.get(name) is None]
        if bad:
            findings.append(blocker("environment", f"`import {name}` fails on {hosts(bad)} with "
                                    f"{bad[0].get('python')}: {bad[0].get(name + '_error')}",
                                    f"install {name} in {where} (or fix the module/conda lines in cluster.setup)"))
    versions = {(r.get("ray"), r.get("vllm")) for r in reports if r.get("ray") and r.get("vllm")}
    if len(versions) > 1:
        findings.append(blocker("environment", f"nodes differ in Ray/vLLM versions: {sorted(versions)}",
                                "use one environment on every node"))
    if model_path:
        unreadable = [r for r in reports if r.get("model_error")]
        if unreadable:
            fix = ("put the model on a filesystem every compute node mounts (not /tmp, /dev/shm or a login-only "
                   "path) and make it readable")
            if profile.runtime != "venv":
                fix += "; containers see only bound paths: add its parent to site.binds"
            findings.append(blocker("model", f"{model_path}/config.json is not readable on {hosts(unreadable)}: "
                                    f"{unreadable[0].get('model_error')}", fix))
        else:
            findings.append(ok("model", f"{model_path} readable on {hosts(reports)}"))
    no_logs = [r for r in reports if r.get("logs_writable") is False]
    if no_logs:
        findings.append(blocker("results", f"the results folder's logs/ is not writable on {hosts(no_logs)}: Slurm "
                                "writes the job's output there and the driver its run folder",
                                "set results_dir to a folder on a filesystem every compute node mounts, writable by you"))
    busy = [r for r in reports if r.get("busy_ports")]
    if busy:
        level = blocker if len(busy) == len(reports) else warning
        ports = sorted({p for r in busy for p in r.get("busy_ports")})
        findings.append(level("port", f"serve port(s) {ports} in use on {hosts(busy)}",
                              "choose another serve.port (a job placed there would fail to bind)"))
    if profile.runtime != "venv":
        no_srun = [r for r in reports if not r.get("srun")]
        if no_srun:
            findings.append(blocker("container", f"srun is not found inside the container on {hosts(no_srun)}: the "
                                    "driver starts each node's Ray with srun from inside it",
                                    "install Slurm's client (same version) in the image, or bind the site's: "
                                    "site.binds: [/usr/bin/srun, /etc/slurm, /run/munge, <libslurm folder>]"))
    if not any(f.check == "environment" for f in findings):
        r = reports[0]
        findings.append(ok("environment", f"{len(reports)} node(s): Python {r.get('python_version')}, Ray "
                           f"{r.get('ray')}, vLLM {r.get('vllm')}, hpcserve {r.get('hpcserve')}"))
    return findings


def probe_failed(profile: SiteProfile, probe: Captured) -> Finding:
    text = probe.text or "no output"
    lower = text.lower()
    if probe.rc is None:
        return blocker("nodes", "the probe step on the compute nodes did not finish in time",
                       "check that the partition's nodes start steps (`srun -N1 hostname`)")
    if "unable to allocate" in lower or "immediate" in lower or "busy" in lower:
        return warning("nodes", f"compute nodes could not be probed now: {text}",
                       "run `hpcserve doctor` again when nodes are free; model, environment and ports are unchecked")
    if "fatal" in lower and profile.runtime != "venv":
        return blocker("container", f"the container did not start on the compute nodes: {text}",
                       "check site.image, and that every path in site.binds exists on the compute nodes")
    if "not found" in lower or "no such file" in lower:
        runtime = profile.step.prefix[0] if profile.step.prefix else "the interpreter"
        return blocker("environment", f"the probe could not start on the compute nodes: {text}",
                       f"make {runtime} available on compute nodes (cluster.setup: module load ...) and check "
                       "site.image and the interpreter path")
    return blocker("nodes", f"the probe step failed (exit {probe.rc}): {text}",
                   "read Slurm's message; fix the partition/account/QOS first if they were reported")


def hosts(reports: list[NodeReport]) -> str:
    return ", ".join(r.host for r in reports)
