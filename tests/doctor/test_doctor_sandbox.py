"""`hpcserve doctor` against the real Slurm sandbox, with setups broken the way sites break them.

Each run reads Slurm (sinfo, sbatch --test-only) and probes the compute nodes with one srun step;
nothing is submitted. Several faults go into one run where they do not hide each other.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from helpers import write_config

pytestmark = pytest.mark.sandbox
DOCTOR = [sys.executable, "-m", "hpcserve.cli", "doctor"]


@pytest.fixture()
def slurm_env(sandbox, monkeypatch):
    for key, value in sandbox.env().items():
        monkeypatch.setenv(key, value)
    return sandbox


def base(tmp_path: Path) -> dict:
    return {"name": "doc", "model": {"path": "builtin:tiny-llama", "dtype": "float32", "max_model_len": 512},
            "cluster": {"scheduler": "slurm", "nodes": 2, "gpus_per_node": 2, "cpus_per_node": 2, "time": "30"},
            "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1},
            "serve": {"host": "0.0.0.0", "port": 8150, "api_key_env": "HPCSERVE_API_KEY"},
            "results_dir": str(tmp_path / "results")}


def doctor(config: Path, *args: str) -> tuple[int, dict[str, list[dict]]]:
    done = subprocess.run([*DOCTOR, str(config), "--json", *args], capture_output=True, text=True, timeout=400)
    assert "Traceback" not in done.stderr, done.stderr
    report = json.loads(done.stdout)
    assert report["exit_code"] == done.returncode
    by_check: dict[str, list[dict]] = {}
    for finding in report["findings"]:
        by_check.setdefault(finding["check"], []).append(finding)
    return done.returncode, by_check


def severities(by_check, check):
    return {f["severity"] for f in by_check.get(check, [])}


def test_a_working_setup_has_no_blocker_and_exits_0(slurm_env, tmp_path):
    code, found = doctor(write_config(tmp_path / "ok.yaml", base(tmp_path)))
    assert code == 0, found
    for check in ("commands", "controller", "partition", "gres", "submission", "environment"):
        assert severities(found, check) == {"ok"}, (check, found.get(check))
    assert "hsn" in found["model"][-1]["what"]  # readable, checked on the nodes themselves


def test_wrong_partition_and_too_short_time_are_blockers_with_fixes(slurm_env, tmp_path):
    config = write_config(tmp_path / "bad.yaml", base(tmp_path), cluster={**base(tmp_path)["cluster"],
                                                                          "partition": "gpu-a100", "time": "1"})
    code, found = doctor(config)
    assert code == 2
    [partition] = found["partition"]
    assert partition["severity"] == "blocker" and "debug" in partition["what"] and "cluster.partition" in partition["fix"]
    [submission] = found["submission"]
    assert "Invalid partition" in submission["what"]
    [time] = found["time"]
    assert time["severity"] == "blocker" and "set cluster.time to at least" in time["fix"]


@pytest.fixture()
def busy_port(slurm_env):
    """Port 8150 taken on every node (another user's server), released afterwards. Each listener lives
    until its stdin closes: nsenter does not pass a TERM on to the process it started in the node."""
    listener = ("import socket,sys; s=socket.socket(); s.bind(('0.0.0.0',8150)); s.listen(); print('up',flush=True); "
                "sys.stdin.read()")
    procs = []
    try:
        for node in slurm_env.node_names():
            proc = subprocess.Popen([*slurm_env.node_exec_argv(node), sys.executable, "-c", listener],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            assert proc.stdout.readline().strip() == "up"
        yield 8150
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=30)
        left = {n: len(slurm_env.node_pids(n)) - 2 for n in slurm_env.node_names()}  # init and slurmd stay
        assert not any(left.values()), f"processes left on nodes: {left}"


@pytest.fixture()
def login_only_model(tmp_path):
    """A model folder in the login node's /dev/shm: each compute node has its own /dev/shm."""
    from hpcserve.models.tiny import tiny_model_path

    folder = Path("/dev/shm") / f"hpcserve-doctor-{uuid.uuid4().hex[:8]}"
    shutil.copytree(tiny_model_path(), folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_node_side_faults_are_found_from_inside_the_nodes(slurm_env, tmp_path, busy_port, login_only_model):
    """GRES type that does not exist, unknown QOS/account, model not on the nodes, vLLM broken in the
    site's environment, serving port busy: each one named, with its fix."""
    shadow = tmp_path / "site-packages"
    (shadow / "vllm").mkdir(parents=True)
    (shadow / "vllm" / "__init__.py").write_text(
        "raise ImportError('libcudart.so.12: cannot open shared object file')\n")
    cfg = base(tmp_path)
    cfg["model"]["path"] = str(login_only_model)
    cfg["cluster"].update(qos="bogus", account="nobody", sbatch_extra=["--gres=gpu:h100:1"],
                          setup=[f"export PYTHONPATH={shadow}"])
    code, found = doctor(write_config(tmp_path / "faults.yaml", cfg))
    assert code == 2
    [submission] = found["submission"]
    assert submission["severity"] == "blocker" and "--gres" in submission["fix"]
    [model] = found["model"]
    assert model["severity"] == "blocker" and "not readable on hsn" in model["what"] and "filesystem" in model["fix"]
    [vllm] = [f for f in found["environment"] if "vllm" in f["what"]]
    assert vllm["severity"] == "blocker" and "libcudart" in vllm["what"] and "install vllm" in vllm["fix"]
    [port] = found["port"]
    assert port["severity"] == "blocker" and "8150" in port["what"] and "serve.port" in port["fix"]
    # The sandbox has no accounting database and does not enforce accounts/QOS: said, not blocked.
    [account] = found["account"]
    assert account["severity"] == "info" and "bogus" in account["what"] and "AccountingStorageEnforce" in account["what"]


def test_site_file_overrides_the_config_and_a_missing_container_runtime_is_named(slurm_env, tmp_path):
    image = tmp_path / "image.sif"
    image.write_text("")
    site = tmp_path / "site.yaml"
    site.write_text(f"runtime: apptainer\nimage: {image}\ncontainer_command: /nonexistent/apptainer\n")
    code, found = doctor(write_config(tmp_path / "c.yaml", base(tmp_path)), "--site", str(site))
    assert code == 2
    [env] = found["environment"]
    assert "/nonexistent/apptainer" in env["what"] and "compute nodes" in env["fix"]


def test_a_bad_site_file_is_one_message_and_exit_2(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("runtime: docker\n")
    config = write_config(tmp_path / "c.yaml", base(tmp_path))
    done = subprocess.run([*DOCTOR, str(config), "--site", str(site)], capture_output=True, text=True, timeout=60,
                          env={**os.environ})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "site.runtime" in done.stderr and "docker" in done.stderr


def test_container_probe_runs_inside_the_image_and_misses_srun_there(slurm_env, tmp_path):
    """With the stand-in runtime (tests/cluster/fake-apptainer): imports are checked in the image's
    environment; an image without Slurm's client is a blocker (the driver calls srun inside it)."""
    image = tmp_path / "image.sif"
    image.write_text(f"PATH={Path(sys.executable).parent}\n")  # the image's PATH: Python, no srun
    cfg = base(tmp_path)
    cfg["site"] = {"runtime": "apptainer", "image": str(image),
                   "container_command": str(Path(__file__).parents[1] / "cluster" / "fake-apptainer")}
    code, found = doctor(write_config(tmp_path / "sif.yaml", cfg))
    assert code == 2
    assert severities(found, "environment") == {"ok"}, found
    [container] = [f for f in found["container"] if f["severity"] == "blocker"]
    assert "srun is not found inside the container on hsn" in container["what"]
    assert "site.binds" in container["fix"]
    # the probe ran through it on both nodes (a call's argv holds the probe's code, over several lines)
    calls = [line.split("\x1f") for line in Path(f"{image}.calls").read_text().splitlines() if "\x1fexec\x1f" in line]
    assert sorted(c[0] for c in calls) == ["hsn1", "hsn2"] and all(c[2:4] == ["--nv", "--bind"] for c in calls)
