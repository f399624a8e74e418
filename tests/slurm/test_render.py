"""The rendered sbatch script: stored references, shell syntax, secrets, and running its shell part.

Regenerate the references after an intended change with
    HPCSERVE_UPDATE_REFERENCES=1 .venv/bin/python -m pytest tests/slurm/test_render.py
which writes each reference that differs and fails that test ("reference updated"), then review the diff
of tests/slurm/data/*.sbatch and rerun without the variable: only a comparison passes.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from hpcserve.core.config import DeploymentConfig, load_config, parse_config
from hpcserve.core.errors import ConfigError
from hpcserve.slurm.render import render_batch_script

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
PYTHON = "/opt/hpcserve/venv/bin/python"
RESULTS = Path("/shared/results")
UPDATE = os.environ.get("HPCSERVE_UPDATE_REFERENCES") == "1"


def config_yaml(cfg: DeploymentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def render(cfg: DeploymentConfig, results_dir: Path = RESULTS, python: str = PYTHON) -> str:
    return render_batch_script(cfg, config_yaml(cfg), python, results_dir)


def example(name: str) -> DeploymentConfig:
    return load_config(ROOT / "examples" / name)


def with_cluster(cfg: DeploymentConfig, **cluster: object) -> DeploymentConfig:
    raw = cfg.model_dump(mode="json")
    raw["cluster"].update(cluster)
    return parse_config(raw)


def assert_matches_reference(text: str, reference: Path) -> None:
    """Passes only when the rendered text equals the stored reference. With HPCSERVE_UPDATE_REFERENCES=1 a
    missing or different reference is written and the test still fails: the new reference is reviewed,
    then the test rerun without the variable (or with it: equal now, it passes)."""
    expected = reference.read_text() if reference.exists() else None
    if text == expected:
        return
    if UPDATE:
        reference.write_text(text)
        pytest.fail(f"reference updated: {reference}: review it (git diff) and rerun without "
                    "HPCSERVE_UPDATE_REFERENCES", pytrace=False)
    if expected is None:
        pytest.fail(f"{reference} is missing: create it with HPCSERVE_UPDATE_REFERENCES=1 and review it")
    diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), text.splitlines(keepends=True),
                                        fromfile=f"{reference.name} (reference)", tofile="rendered now"))
    pytest.fail(f"rendered script differs from {reference}; if intended, rerun with "
                f"HPCSERVE_UPDATE_REFERENCES=1 and review:\n{diff}", pytrace=False)


PROFILE_EXAMPLES = [("site-venv.yaml", "site-venv.sbatch"), ("site-apptainer.yaml", "site-apptainer.sbatch"),
                    ("site-pyxis.yaml", "site-pyxis.sbatch"), ("site-no-gres.yaml", "site-no-gres.sbatch")]


@pytest.mark.parametrize("example_file, reference", [
    ("local.yaml", "local.sbatch"),
    ("slurm-llama-70b.yaml", "slurm-llama-70b.sbatch"),
    *PROFILE_EXAMPLES,
])
def test_rendered_script_matches_reference(example_file, reference):
    assert_matches_reference(render(example(example_file)), DATA / reference)


def test_directives_only_for_what_is_set():
    local = render(example("local.yaml"))
    big = render(example("slurm-llama-70b.yaml"))
    for option in ("--gpus-per-node", "--partition", "--account", "--qos", "--exclusive"):
        assert f"#SBATCH {option}" not in local
        assert f"#SBATCH {option}" in big
    assert "#SBATCH --gpus-per-node=4\n" in big and "#SBATCH --nodes=2\n" in big


@pytest.mark.parametrize("example_file", ["local.yaml", "slurm-llama-70b.yaml", *(e for e, _ in PROFILE_EXAMPLES)])
def test_bash_accepts_the_rendered_script(example_file, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render(example(example_file)))
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_the_api_key_value_never_appears(monkeypatch):
    secret = "sk-0123456789abcdef-very-secret"
    monkeypatch.setenv("HPCSERVE_API_KEY", secret)
    script = render(example("slurm-llama-70b.yaml"))
    assert secret not in script
    assert "api_key_env: HPCSERVE_API_KEY" in script   # only the variable's name travels


def test_a_key_value_pasted_into_the_config_is_refused(monkeypatch):
    secret = "sk-0123456789abcdef-very-secret"
    monkeypatch.setenv("HPCSERVE_API_KEY", secret)
    leaky = with_cluster(example("slurm-llama-70b.yaml"), setup=[f"export TOKEN={secret}"])
    with pytest.raises(ConfigError, match=r"\$HPCSERVE_API_KEY") as err:
        render(leaky)
    assert secret not in str(err.value)


def test_rendering_is_stable():
    cfg = example("slurm-llama-70b.yaml")
    assert render(cfg) == render(cfg)


def test_relative_results_dir_is_refused():
    with pytest.raises(ValueError, match="absolute"):
        render(example("local.yaml"), results_dir=Path("results"))


def test_config_that_would_end_the_heredoc_is_refused():
    cfg = example("local.yaml")
    with pytest.raises(ValueError, match="HPCSERVE_CONFIG"):
        render_batch_script(cfg, "name: x\nHPCSERVE_CONFIG\n", PYTHON, RESULTS)


def test_multi_line_sbatch_option_is_refused():
    cfg = with_cluster(example("slurm-llama-70b.yaml"), sbatch_extra=["--exclusive\nrm -rf ~"])
    with pytest.raises(ConfigError, match="sbatch_extra"):
        render(cfg)


def test_values_with_spaces_are_quoted():
    cfg = with_cluster(example("slurm-llama-70b.yaml"), partition="gpu a100")
    script = render(cfg, results_dir=Path("/shared/my results"))
    assert "#SBATCH --partition='gpu a100'\n" in script
    assert "#SBATCH --output='/shared/my results/logs/.slurm-%j.out'\n" in script
    assert "RUN_DIR='/shared/my results/logs'/llama-70b-$SLURM_JOB_ID\n" in script


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_shell_part_runs_as_slurm_would_run_it(tmp_path):
    """Run the script with bash as Slurm would (SLURM_JOB_ID set, early log present), with a stub
    interpreter: the run folder gets the config and the log, and the driver gets the run folder."""
    results = tmp_path / "res ults"
    logs = results / "logs"
    logs.mkdir(parents=True)
    (logs / ".slurm-42.out").write_text("early output\n")
    stub = tmp_path / "python"
    stub.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$STUB_ARGS"\n')
    stub.chmod(0o755)
    cfg = with_cluster(example("local.yaml"), setup=['echo "setup ran ${NOT_SET_ANYWHERE}" >> "$STUB_SETUP"'])
    script = tmp_path / "job.sbatch"
    script.write_text(render_batch_script(cfg, config_yaml(cfg), str(stub), results))
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "42",
           "STUB_ARGS": str(tmp_path / "args"), "STUB_SETUP": str(tmp_path / "setup")}
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    run_dir = logs / "local-tiny-42"
    assert (run_dir / "slurm.out").read_text() == "early output\n"
    assert not (logs / ".slurm-42.out").exists()
    assert yaml.safe_load((run_dir / "config.yaml").read_text()) == cfg.model_dump(mode="json")
    assert (tmp_path / "args").read_text().splitlines() == ["-m", "hpcserve.deployment.driver", str(run_dir)]
    assert (tmp_path / "setup").read_text() == "setup ran \n"


# ---------------------------------------------------------------- site profiles

def with_site(cfg: DeploymentConfig, **site: object) -> DeploymentConfig:
    raw = cfg.model_dump(mode="json")
    raw["site"].update(site)
    return parse_config(raw)


def last_line(script: str) -> str:
    return script.rstrip("\n").splitlines()[-1]


def test_venv_profile_runs_the_driver_directly_and_exports_nothing():
    script = render(example("site-venv.yaml"))
    assert last_line(script) == f'exec {PYTHON} -m hpcserve.deployment.driver "$RUN_DIR"'
    assert "HPCSERVE_SITE_STEP" not in script


def test_apptainer_profile_wraps_the_driver_and_hands_the_wrapper_to_the_nodes():
    script = render(example("site-apptainer.yaml"))
    wrapper = ("apptainer exec --nv --bind /shared/results,/shared/models/Meta-Llama-3.1-70B-Instruct,"
               "/etc/slurm,/run/munge,/usr/bin/srun,/usr/lib64/slurm,/scratch /shared/images/hpcserve-vllm.sif")
    assert last_line(script) == f'exec {wrapper} python3 -m hpcserve.deployment.driver "$RUN_DIR"'
    assert f'"prefix":{json.dumps(wrapper.split())}'.replace(", ", ",") in script


def test_apptainer_on_cpus_has_no_nv_and_singularity_works_too():
    cfg = with_site(with_cluster(example("local.yaml"), scheduler="slurm"), runtime="apptainer", image="/img/x.sif", container_command="singularity")
    assert "singularity exec --bind /shared/results /img/x.sif python3 -m hpcserve.deployment.driver" in last_line(render(cfg))


def test_pyxis_profile_runs_the_driver_as_a_container_step():
    script = render(example("site-pyxis.yaml"))
    line = last_line(script)
    assert line.startswith("exec srun --nodes=1 --ntasks=1 --overlap --export=ALL "
                           "--container-image=/shared/images/hpcserve-vllm.sqsh --container-mounts=")
    assert "/shared/hf-cache:/root/.cache/huggingface" in line and ",/tmp:/tmp " in line
    assert line.endswith(' python3 -m hpcserve.deployment.driver "$RUN_DIR"')


def test_no_gres_requests_no_gpus_and_takes_whole_nodes():
    script = render(example("site-no-gres.yaml"))
    assert "--gpus-per-node" not in script and "--gres" not in script
    assert "#SBATCH --exclusive\n" in script
    assert '"request_gpus":false' in script


def test_no_gres_does_not_repeat_a_configured_exclusive():
    cfg = with_site(example("slurm-llama-70b.yaml"), gres=False)
    script = render(cfg)
    assert script.count("#SBATCH --exclusive") == 1 and "--gpus-per-node" not in script


def test_no_gres_on_a_cpu_partition_renders_no_gpu_option_and_no_exclusive():
    cfg = with_cluster(with_site(example("local.yaml"), gres=False), scheduler="slurm", partition="cpu")
    script = render(cfg)
    assert "--gpus" not in script and "--exclusive" not in script and "--gres" not in script


def test_container_image_with_spaces_is_quoted(tmp_path):
    cfg = with_site(with_cluster(example("local.yaml"), scheduler="slurm"), runtime="apptainer", image="/my images/x.sif")
    script = render(cfg)
    assert "'/my images/x.sif' python3 -m hpcserve.deployment.driver" in last_line(script)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], timeout=30).returncode == 0


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_apptainer_script_hands_the_node_wrapper_to_the_driver(tmp_path):
    """Run the script's shell part with a stand-in for apptainer: the driver is started through it,
    and the environment the driver sees tells the launcher the same wrapper for every node."""
    from hpcserve.raycluster.launch import SrunLauncher, srun_argv
    from hpcserve.site.profiles import StepWrap

    results = tmp_path / "results"
    (results / "logs").mkdir(parents=True)
    (results / "logs" / ".slurm-7.out").write_text("")
    fake = tmp_path / "apptainer"
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$STUB_ARGS"\nenv > "$STUB_ENV"\n')
    fake.chmod(0o755)
    cfg = with_site(with_cluster(example("local.yaml"), scheduler="slurm"), runtime="apptainer", image="/img/x.sif", container_command=str(fake))
    script = tmp_path / "job.sbatch"
    script.write_text(render(cfg, results_dir=results))
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7", "STUB_ARGS": str(tmp_path / "args"),
           "STUB_ENV": str(tmp_path / "env")}
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    run_dir = results / "logs" / "local-tiny-7"
    assert (tmp_path / "args").read_text().splitlines() == [
        "exec", "--bind", str(results), "/img/x.sif", "python3", "-m", "hpcserve.deployment.driver", str(run_dir)]
    seen = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    step = SrunLauncher(StepWrap.from_env(seen)).step
    argv = srun_argv("n2", ["python3", "-m", "x"], 0, step)
    assert argv[argv.index("--export=ALL") + 1:] == [str(fake), "exec", "--bind", str(results), "/img/x.sif",
                                                     "python3", "-m", "x"]
