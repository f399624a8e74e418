"""Site profiles as data: what surrounds the driver and each node's Ray, and how srun is called."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcserve.core.config import parse_config
from hpcserve.raycluster.launch import SrunLauncher, srun_argv
from hpcserve.site.profiles import STEP_ENV, StepWrap, container_mounts, profile_for

RESULTS = Path("/shared/results")


def config(site: dict | None = None, gpus: int = 4, model: str = "/shared/models/m", **cluster) -> object:
    return parse_config({"name": "x", "model": {"path": model},
                         "cluster": {"scheduler": "slurm", "gpus_per_node": gpus, **cluster},
                         "site": site or {}})


def test_venv_with_gres_is_the_plain_launch():
    profile = profile_for(config(), RESULTS)
    assert profile.step.is_plain and profile.driver == () and profile.python is None and not profile.exclusive


def test_apptainer_prefix_binds_results_model_and_site_paths_once():
    cfg = config({"runtime": "apptainer", "image": "/i.sif", "binds": ["/scratch", "/shared/results"]})
    profile = profile_for(cfg, RESULTS)
    assert profile.driver == ("apptainer", "exec", "--nv", "--bind", "/shared/results,/shared/models/m,/scratch", "/i.sif")
    assert profile.step.prefix == profile.driver and profile.step.srun_options == ()
    assert profile.python == "python3"


def test_hub_ids_and_builtin_models_are_not_bound():
    assert container_mounts(config(model="org/model"), RESULTS) == ["/shared/results"]
    assert container_mounts(config(model="builtin:tiny-llama"), RESULTS) == ["/shared/results"]


def test_pyxis_options_mount_src_at_dst_and_tmp_for_ray():
    cfg = config({"runtime": "pyxis", "image": "/i.sqsh", "binds": ["/a:/b"]})
    profile = profile_for(cfg, RESULTS)
    assert profile.step.srun_options == (
        "--container-image=/i.sqsh",
        "--container-mounts=/shared/results:/shared/results,/shared/models/m:/shared/models/m,/a:/b,/tmp:/tmp")
    assert profile.step.prefix == ()
    assert profile.driver[:4] == ("srun", "--nodes=1", "--ntasks=1", "--overlap")


def test_no_gres_steps_ask_for_no_gpus():
    step = profile_for(config({"gres": False}), RESULTS).step
    argv = srun_argv("n1", ["python", "-m", "x"], 4, step)
    assert not any(a.startswith("--gpus") for a in argv)
    assert "--gpus-per-node=4" in srun_argv("n1", ["python"], 4, StepWrap())


def test_srun_argv_puts_options_before_the_wrapper_and_the_wrapper_before_the_command():
    step = StepWrap(("--container-image=i",), ("apptainer", "exec", "i"), True)
    argv = srun_argv("n3", ["python", "-m", "node"], 2, step)
    assert argv[:4] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=n3"]
    assert argv[-7:] == ["--container-image=i", "apptainer", "exec", "i", "python", "-m", "node"]
    assert argv.index("--gpus-per-node=2") < argv.index("--container-image=i")


@pytest.mark.parametrize("step", [StepWrap(), StepWrap(("--a",), ("w", "x y"), False)])
def test_step_round_trips_through_the_environment(step):
    assert StepWrap.from_env({STEP_ENV: step.to_env()}) == step


def test_launcher_reads_the_batch_scripts_step_from_the_environment(monkeypatch):
    monkeypatch.setenv(STEP_ENV, StepWrap((), ("wrap",), False).to_env())
    assert SrunLauncher().step.prefix == ("wrap",)
    monkeypatch.delenv(STEP_ENV)
    assert SrunLauncher().step == StepWrap()
