"""Broken configs: `hpcserve up` exits with code 2, one clear message naming the field, no traceback,
and nothing started (no registry entry, no run folder, no process)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml
from helpers import REPO, run_cli, run_cli_here

LOCAL = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())


def variant(**changes) -> str:
    data = yaml.safe_load(yaml.safe_dump(LOCAL))
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return yaml.safe_dump(data, sort_keys=False)


DELETE = object()

CASES = {
    "bad-yaml": ("name: x\nmodel:\n  path: [unclosed\n", "not valid YAML at line"),
    "top-level-list": ("- a\n- b\n", "top level must be a mapping"),
    "unknown-top-key": (variant(modle={"path": "x"}), "unknown key 'modle'. Valid keys here: name, model"),
    "unknown-nested-key": (variant(cluster__gpu=2), "unknown key 'cluster.gpu'. Valid keys here: scheduler, nodes"),
    "wrong-type": (variant(cluster__nodes="two"), "'cluster.nodes' = 'two'"),
    "negative-gpus": (variant(cluster__gpus_per_node=-1), "'cluster.gpus_per_node' = -1: Input should be greater than or equal to 0"),
    "missing-model": (variant(model=DELETE), "'model' is required"),
    "missing-model-path": (variant(model__path=DELETE), "'model.path' is required"),
    "model-folder-missing": (variant(model__path="/nonexistent/llama"), "'model.path' = '/nonexistent/llama': no such folder"),
    "bad-dtype": (variant(model__dtype="fp8"), "'model.dtype' = 'fp8'"),
    "port-out-of-range": (variant(serve__port=70000), "'serve.port' = 70000: Input should be less than or equal to 65535"),
    "bad-name": (variant(name="My Model"), "'name' = 'My Model'"),
    "local-multi-node": (variant(cluster__nodes=2), "scheduler 'local' runs on this machine only"),
    "too-much-parallelism": (variant(parallelism={"tensor": 4, "pipeline": 1, "replicas": 1}),
                             "parallelism needs 4 workers"),
    "tensor-not-dividing-heads": (variant(parallelism={"tensor": 3, "pipeline": 1, "replicas": 1}, cluster__cpus_per_node=4),
                                  "tensor 3 does not divide the 4 attention heads"),
    "bad-slurm-time": (variant(cluster__time="1h"), "'cluster.time' = '1h': not a Slurm time"),
    "ray-on-cpu": (variant(engine__executor="ray"), "engine.executor 'ray' needs GPUs"),
    "api-key-in-args": (variant(engine__args=["--api-key", "secret"]), "--api-key would show in process lists"),
    "api-key-with-underscore": (variant(engine__args=["--api_key=secret"]), "--api-key would show in process lists"),
    "api-key-in-group-args": (variant(replica_groups=[{"engine_args": ["--api-k", "s"]}]),
                              "'replica_groups.0.engine_args' = ['--api-k', '***']: --api-key would show"),
    "secret-in-engine-env": (variant(engine__env={"HF_TOKEN": "hf_x"}),
                             "'engine.env' = {'HF_TOKEN': '***'}: HF_TOKEN looks like a secret"),
    "no-key-off-loopback": (variant(serve__host="0.0.0.0", serve__api_key_env=None, serve__insecure_no_api_key=True),
                            "serve.insecure_no_api_key leaves every engine open"),
    "no-key-and-a-key": (variant(serve__insecure_no_api_key=True), "serve.insecure_no_api_key and serve.api_key_env"),
    "unknown-builtin": (variant(model__path="builtin:gpt-9"), "unknown builtin model"),
    "autoscale-without-router": (variant(autoscale={"min": 1, "max": 2}, serve__router=False),
                                 "autoscale adds and removes replicas (Slurm jobs or local processes) behind the"),
    "autoscale-zero-without-idle": (variant(autoscale={"min": 0, "max": 2}),
                                    "autoscale.min 0 lets the model sleep: give autoscale.idle_s"),
    "autoscale-idle-without-zero": (variant(autoscale={"min": 1, "idle_s": 60}),
                                    "autoscale.idle_s is the idle time before the last replica goes, with min 0"),
    "autoscale-wake-wait-zero": (variant(autoscale={"min": 0, "idle_s": 60, "wake_wait_s": 0}),
                                 "'autoscale.wake_wait_s' = 0: Input should be greater than 0"),
    "groups-without-router": (variant(replica_groups=[{"replicas": 1}], serve__router=False),
                              "replica_groups[1]: replica groups run behind the endpoint: set serve.router true"),
    "group-too-big": (variant(replica_groups=[{"tensor": 3, "cpus_per_node": 2}]),
                      "replica_groups[1]: a replica spanning nodes needs tensor x pipeline (3) to be a multiple"),
    "autoscale-min-above-max": (variant(autoscale={"min": 3, "max": 2}, cluster__scheduler="slurm"),
                                "autoscale.min (3) is larger than autoscale.max (2)"),
    "burst-on-local": (variant(autoscale={"max": 2, "burst": {"partition": "scavenger"}}),
                       "autoscale.burst places replicas on a preemptible Slurm partition: it needs cluster.scheduler"),
    "burst-on-main-partition": (variant(autoscale={"burst": {"partition": "gpu"}}, cluster__scheduler="slurm",
                                        cluster__partition="gpu"),
                                "autoscale.burst.partition 'gpu' is cluster.partition, with the same QOS"),
    "burst-max-zero": (variant(autoscale={"burst": {"partition": "scavenger", "max": 0}}, cluster__scheduler="slurm"),
                       "'autoscale.burst.max' = 0: Input should be greater than or equal to 1"),
    "burst-min-above-total": (variant(autoscale={"min": 4, "max": 2, "burst": {"partition": "scavenger", "max": 1}},
                                      cluster__scheduler="slurm"),
                              "autoscale.min (4) is larger than autoscale.max (2) + autoscale.burst.max (1)"),
    "container-on-local": (variant(site={"runtime": "apptainer", "image": "/x.sif"}),
                           "site.runtime 'apptainer' wraps Slurm job steps"),
    "container-without-image": (variant(site={"runtime": "pyxis"}), "site.runtime 'pyxis' needs site.image"),
    "unknown-catalog-model": (variant(model__catalog="llama-9-1t"), "llama-9-1t"),
}


def registry(home: Path) -> set[str]:
    """Deployments known to hpcserve (earlier tests of the session may have left failed ones)."""
    folder = home / "deployments"
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_config_is_refused_cleanly(case, tmp_path, hpcserve_home):
    text, expected = CASES[case]
    text = text.replace("results_dir: results", f"results_dir: {tmp_path / 'results'}")
    config = tmp_path / f"{case}.yaml"
    config.write_text(text)
    registered = registry(hpcserve_home)
    result = run_cli_here("up", str(config))  # a process's own stderr: the tests below
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith("error:"), result.stderr
    assert result.stderr.count("error:") == 1
    assert expected in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "results" / "logs").exists() or not any((tmp_path / "results" / "logs").iterdir())
    assert registry(hpcserve_home) == registered  # nothing registered, hence nothing started


def test_port_in_use_is_refused(tmp_path, hpcserve_home):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = tmp_path / "busy.yaml"
        config.write_text(variant(serve__port=port, results_dir=str(tmp_path / "results")))
        registered = registry(hpcserve_home)
        result = run_cli("up", str(config), timeout=120)
    assert result.returncode == 2
    assert f"port {port} is already in use" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "results" / "logs").exists() or not any((tmp_path / "results" / "logs").iterdir())
    assert registry(hpcserve_home) == registered


def test_a_results_folder_others_can_write_is_refused(tmp_path, hpcserve_home):
    """Issue 15: a group- or world-writable results folder lets others plant config.yaml or Ray's token."""
    project = tmp_path / "project"
    project.mkdir()
    project.chmod(0o777)
    config = tmp_path / "open.yaml"
    config.write_text(variant(results_dir=str(project / "results")))
    registered = registry(hpcserve_home)
    result = run_cli("up", str(config), timeout=120)
    message = " ".join(result.stderr.split())
    assert result.returncode == 2 and "Traceback" not in result.stderr and result.stderr.count("error:") == 1
    assert f"results_dir {project / 'results'}: {project} every user can write into it" in message
    assert "Set results_dir to a folder only you can write" in message
    assert not (project / "results").exists() and registry(hpcserve_home) == registered  # nothing started


def test_missing_file_and_bad_arguments(tmp_path):
    missing = run_cli("up", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
    unknown = run_cli("down", "never-started")
    assert unknown.returncode == 2 and "no deployment named 'never-started'" in unknown.stderr
    bad_option = run_cli("up", "--no-such-option")
    assert bad_option.returncode == 2 and "Traceback" not in bad_option.stderr


def test_valid_examples_load():
    from hpcserve.core.config import load_config

    for example in sorted((REPO / "examples").glob("*.yaml")):
        cfg = load_config(example)
        assert cfg.name


def test_layout_problem_is_pure_and_explains():
    from hpcserve.core.config import ClusterSpec, Layout
    from hpcserve.core.config_checks import layout_problem

    gpu = ClusterSpec(scheduler="slurm", nodes=2, gpus_per_node=4)
    assert layout_problem(Layout(tensor=4, pipeline=2), gpu) is None
    assert "multiple of the GPUs per node" in layout_problem(Layout(tensor=3, pipeline=2), gpu)
    assert "needs 16 workers" in layout_problem(Layout(tensor=8, pipeline=2), gpu)


@pytest.mark.parametrize("name,secret", [("HF_TOKEN", True), ("WANDB_API_KEY", True), ("DB_PASSWORD", True),
                                         ("AWS_SECRET_ACCESS_KEY", True), ("OPENAI_APIKEY", True),
                                         ("hf_token", True), ("HF_TOKEN_PATH", False), ("KEY_FILE", False),
                                         ("TOKENIZERS_PARALLELISM", False), ("VLLM_MAX_TOKENS", False),
                                         ("VLLM_CPU_KVCACHE_SPACE", False), ("OMP_NUM_THREADS", False)])
def test_secret_looking_variable_names(name, secret):
    from hpcserve.core.config_checks import looks_secret

    assert looks_secret(name) is secret


@pytest.mark.parametrize("arg,is_key", [("--api-key", True), ("--api-key=x", True), ("--api_key", True),
                                        ("--api_key=x", True), ("--api-k", True), ("--api-ke=x", True),
                                        ("--api-server-count", False), ("--api", False), ("--middleware", False),
                                        ("api-key", False)])
def test_every_spelling_vllm_reads_as_api_key(arg, is_key):
    from hpcserve.core.config_checks import is_api_key_option

    assert is_api_key_option(arg) is is_key


def test_errors_never_quote_a_secret():
    from hpcserve.core.config_errors import redacted

    assert redacted(["engine", "env"], {"HF_TOKEN": "hf_x", "A": "b"}) == {"HF_TOKEN": "***", "A": "***"}
    assert redacted(["engine", "args"], ["--api-key", "s", "--x", "--api_key=t"]) == ["--api-key", "***", "--x",
                                                                                      "--api_key=***"]
    assert redacted(["serve", "port"], 70000) == 70000
