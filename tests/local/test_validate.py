"""`hpcserve validate`: a real single-node run on vLLM (CPU) writes plausible figures."""

from __future__ import annotations

import json

import pytest
from helpers import REPO, SMALL_KV_CACHE, free_port, run_cli, write_config

pytestmark = pytest.mark.slow


def test_validate_writes_plausible_figures(tmp_path, hpcserve_home):
    results = tmp_path / "results"
    config = write_config(tmp_path / "v.yaml", REPO / "examples" / "local.yaml", name="t-valid",
                          serve={"port": free_port()}, results_dir=str(results),
                          engine={"args": ["--enforce-eager", *SMALL_KV_CACHE]})  # the compile path: tests/local/conftest.py
    done = run_cli("validate", str(config), "--concurrency", "4", "--num-prompts", "12", "--output-len", "16")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((results / "logs" / "t-valid" / "validation.json").read_text())
    assert report["ok"] and (results / "logs" / "t-valid" / "validation.md").is_file()
    assert [load["concurrency"] for load in report["loads"]] == [1, 4]
    for load in report["loads"]:
        assert load["failed"] == 0 and load["requests_per_s"] > 0 and load["output_tokens_per_s"] > 0
        assert 0 < load["ttft_p50_ms"] < load["e2e_p50_ms"]
    memory = report["memory"]
    assert memory["samples_during_load"] > 0 and memory["samples_during_serving"] > 0
    assert memory["engine_rss_peak_mb"] > 100  # a vLLM engine with a model loaded
    assert 0 < report["model_load_s"] < report["up_to_ready_s"]
    assert run_cli("status", "t-valid-validate").returncode == 2  # stopped and forgotten
