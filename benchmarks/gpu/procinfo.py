"""How the serving processes run: niceness, oom_score_adj, CPU affinity, threads, cgroup, environment.

usage: procinfo.py LABEL OUT.json
Finds vLLM's API process, its engine core, vLLM's Ray GPU workers, our EngineHost actor and the raylet
(by command line / process title) and writes one JSON object per process. Values of variables whose
names look secret (KEY, TOKEN, SECRET, PASSWORD) are replaced by '<redacted>'. Compare two dumps with
`procinfo.py --diff A.json B.json`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import psutil

ROLES = [("engine_host", re.compile(r"ray::EngineHost")),
         ("gpu_worker", re.compile(r"ray::RayWorker")),  # vLLM 0.26: RayWorkerProc
         ("engine_core", re.compile(r"EngineCore")),
         ("api_server", re.compile(r"(vllm serve|vllm_cli serve|APIServer)")),
         ("raylet", re.compile(r"/raylet( |$)"))]
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.I)


def role_of(cmdline: str) -> str | None:
    for role, pattern in ROLES:
        if pattern.search(cmdline):
            return role
    return None


def redact(env: dict[str, str]) -> dict[str, str]:
    return {k: ("<redacted>" if SECRET.search(k) else v) for k, v in sorted(env.items())}


def describe(proc: psutil.Process, role: str) -> dict:
    pid = proc.pid
    info = {"role": role, "pid": pid, "ppid": proc.ppid(), "cmd": " ".join(proc.cmdline())[:160],
            "nice": proc.nice(), "threads": proc.num_threads(), "cpus": sorted(proc.cpu_affinity()),
            "oom_score_adj": int(Path(f"/proc/{pid}/oom_score_adj").read_text()),
            "cgroup": Path(f"/proc/{pid}/cgroup").read_text().strip()}
    try:
        info["env"] = redact(proc.environ())
    except psutil.Error:
        info["env"] = None
    return info


def dump(label: str) -> list[dict]:
    out = []
    for proc in psutil.process_iter():
        try:
            role = role_of(" ".join(proc.cmdline()) or proc.name())
            if role:
                out.append(describe(proc, role))
        except (psutil.Error, OSError):
            continue
    return [{"label": label, **item} for item in sorted(out, key=lambda i: (i["role"], i["pid"]))]


def diff(a: list[dict], b: list[dict]) -> None:
    """Per role: the attributes and environment variables that differ between two dumps."""
    first = lambda items, role: next((i for i in items if i["role"] == role), None)  # noqa: E731
    for role, _ in ROLES:
        x, y = first(a, role), first(b, role)
        if not x or not y:
            print(f"{role}: only in {'first' if x else 'second' if y else 'neither'}")
            continue
        for key in ("nice", "oom_score_adj", "threads", "cpus", "cgroup"):
            if x[key] != y[key]:
                print(f"{role}: {key} {x[key]} | {y[key]}")
        ex, ey = x.get("env") or {}, y.get("env") or {}
        for name in sorted(set(ex) | set(ey)):
            if ex.get(name) != ey.get(name):
                print(f"{role}: env {name}={ex.get(name, '<unset>')[:80]} | {ey.get(name, '<unset>')[:80]}")


if __name__ == "__main__":
    if sys.argv[1] == "--diff":
        diff(json.loads(Path(sys.argv[2]).read_text()), json.loads(Path(sys.argv[3]).read_text()))
    else:
        Path(sys.argv[2]).write_text(json.dumps(dump(sys.argv[1]), indent=1))
