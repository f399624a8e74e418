"""Site profiles end to end on the sandbox: venv (setup activates it), no GRES (GPUs without Slurm's
GRES), and apptainer (a faithful stand-in runtime: Debian 12 and PyPI ship no Apptainer).

The pyxis profile needs pyxis's SPANK plugin in slurmd: it is checked by its rendered reference
script (tests/slurm/data/site-pyxis.sbatch) and unit tests only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import run_cli, write_config
from test_distributed_serving import deployed, greedy_ids
from test_slurm_ray import squeue_empty

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]
HERE = Path(__file__).parent
FAKE_APPTAINER = HERE / "fake-apptainer"


def engine_environments(port: int) -> list[dict[str, str]]:
    """The environment of every vLLM engine process serving on `port` (on any sandbox node)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if "hpcserve.engine.vllm_cli" in argv and str(port) in argv:
            try:
                found.append(proc.environ())
            except psutil.Error:
                continue
    return found


def test_venv_profile_setup_activates_the_environment_on_the_nodes(slurm_env, tmp_path):
    venv = Path(sys.prefix)
    config = write_config(tmp_path / "venv.yaml", HERE / "sandbox-site-venv.yaml",
                          results_dir=str(tmp_path / "results"),
                          cluster={"setup": [f"source {venv}/bin/activate"]})
    with deployed(config, "sb-venv") as status:
        replica = status["replicas"][0]
        assert status["status"] == "ready" and replica["healthy"]
        assert len(greedy_ids(replica["url"], os.environ["HPCSERVE_API_KEY"])) == 16
        envs = engine_environments(8500)
        assert envs and all(e.get("VIRTUAL_ENV") == str(venv) for e in envs)  # setup reached the engine
        script = (Path(status["run_dir"]) / "job.sbatch").read_text()
        assert f"source {venv}/bin/activate" in script and "HPCSERVE_SITE_STEP" not in script


def test_no_gres_profile_gives_ray_the_gpus_without_asking_slurm(slurm_env, tmp_path):
    config = write_config(tmp_path / "nogres.yaml", HERE / "sandbox-site-nogres.yaml",
                          results_dir=str(tmp_path / "results"))
    done = run_cli("check", str(config), timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = next((tmp_path / "results" / "logs").glob("sb-nogres-check-*"))
    script = (run_dir / "job.sbatch").read_text()
    assert "--gpus-per-node" not in script and "#SBATCH --exclusive\n" in script
    job_id = run_dir.name.rsplit("-", 1)[1]
    job = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
    assert "JobState=COMPLETED" in job and "gres/gpu" not in job and "TresPerNode" not in job, job
    assert "NumCPUs=8" in job  # --exclusive: both nodes whole (4 CPUs each), not 2 x 2
    health = json.loads((run_dir / "health.json").read_text())
    assert health["ok"] and all(len(n["ray_gpu_ids"]) == 2 for n in health["nodes"])
    assert squeue_empty(os.environ)


def fake_image(folder: Path) -> Path:
    """The stand-in image: its environment puts this checkout's interpreter (with hpcserve, Ray, vLLM)
    and Slurm's client first on PATH, as an image with them installed would."""
    image = folder / "hpcserve.sif"
    path = [str(Path(sys.executable).parent), str(Path(shutil.which("srun")).parent), "/usr/bin", "/bin"]
    image.write_text(f"PATH={':'.join(dict.fromkeys(path))}\n")
    return image


def calls(image: Path) -> list[tuple[str, list[str]]]:
    lines = Path(f"{image}.calls").read_text().splitlines()
    return [(fields[0], fields[1:]) for fields in (line.split("\x1f") for line in lines)]


def test_apptainer_profile_runs_driver_ray_and_engines_inside_the_container(slurm_env, tmp_path):
    image = fake_image(tmp_path)
    results = tmp_path / "results"
    config = write_config(tmp_path / "sif.yaml", HERE / "sandbox-site-apptainer.yaml", results_dir=str(results),
                          site={"runtime": "apptainer", "image": str(image), "container_command": str(FAKE_APPTAINER)})
    with deployed(config, "sb-sif") as status:
        replica = status["replicas"][0]
        assert replica["healthy"] and len(greedy_ids(replica["url"], os.environ["HPCSERVE_API_KEY"])) == 16
        envs = engine_environments(8520)
        assert envs and all(e.get("APPTAINER_CONTAINER") == str(image) for e in envs)
    made = calls(image)
    # one driver (on the first node, from the batch script) and one Ray node process per node
    drivers = [(host, argv) for host, argv in made if "hpcserve.deployment.driver" in argv]
    nodes = sorted((host, argv[argv.index("hpcserve.raycluster.node") + 1]) for host, argv in made
                   if "hpcserve.raycluster.node" in argv)
    first, second = slurm_env.node_names()[:2]
    assert len(drivers) == 1 and drivers[0][0] == first
    assert nodes == [(first, "head"), (second, "worker")]
    assert len(made) == 3  # nothing else was started, and nothing outside the container
    for _, argv in made:
        assert argv[:3] == ["exec", "--bind", str(results.resolve())] and argv[3] == str(image)
    # the driver: the image's python3 (found on its PATH); Ray on each node: the driver's interpreter,
    # which is the image's, by its full path
    assert drivers[0][1][4] == "python3"
    assert all(argv[4] == str(Path(sys.executable).parent / "python3") for _, argv in made if argv != drivers[0][1])
