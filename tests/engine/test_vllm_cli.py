"""hpcserve.engine.vllm_cli on CPU: the engine's processes start with fork, unless the user chose."""

from __future__ import annotations

import os
import sys
import types

import pytest

from hpcserve.engine import vllm_cli


@pytest.fixture()
def cpu_platform(monkeypatch):
    """A stand-in for vllm.platforms.cpu whose config hook forces spawn, as vLLM's does."""
    class CpuPlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            vllm_config["checked"] = True
            os.environ[vllm_cli.START_METHOD] = "spawn"

    module = types.ModuleType("vllm.platforms.cpu")
    module.CpuPlatform = CpuPlatform
    monkeypatch.setitem(sys.modules, "vllm.platforms.cpu", module)
    # Set, then deleted: so that monkeypatch removes what the hook writes (a start method left in this
    # process's environment reached every engine the later tests started from it)
    monkeypatch.setenv(vllm_cli.START_METHOD, "")
    monkeypatch.delenv(vllm_cli.START_METHOD)
    return CpuPlatform


def test_engine_processes_fork_after_vllms_cpu_config(cpu_platform, monkeypatch):
    vllm_cli._fork_on_cpu()
    config: dict = {}
    cpu_platform.check_and_update_config(config)
    assert config == {"checked": True}  # vLLM's own hook still ran
    assert os.environ[vllm_cli.START_METHOD] == "fork"


@pytest.mark.parametrize("chosen", ["spawn", "fork"])
def test_a_start_method_the_user_set_is_kept(cpu_platform, monkeypatch, chosen):
    monkeypatch.setenv(vllm_cli.START_METHOD, chosen)
    vllm_cli._fork_on_cpu()
    cpu_platform.check_and_update_config({})
    assert os.environ[vllm_cli.START_METHOD] == chosen
