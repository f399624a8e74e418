"""The shared compile cache: one folder per model x vLLM version x layout, and a hit or a miss read from
the engine's own log lines (saved from vLLM 0.32 on CPU and vLLM's loader messages)."""

from __future__ import annotations

import pytest

from hpcserve.core.config import Layout, parse_config
from hpcserve.core.errors import ConfigError
from hpcserve.engine.compile_cache import CacheUse, cache_env, cache_folder, cache_use

BASE = {"name": "c", "model": {"path": "/models/llama", "served_name": "llama", "dtype": "bfloat16"}}


def test_one_folder_per_model_version_and_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCSERVE_CACHE", str(tmp_path))
    cfg = parse_config(BASE)
    one = cache_folder(cfg, "/models/llama", Layout(tensor=2), "0.26.0")
    assert one.parent.parent.parent == tmp_path / "compile"
    assert one.name == "tp2-pp1-bfloat16" and one.parent.name == "vllm-0.26.0"
    assert cache_folder(cfg, "/models/llama", Layout(tensor=2), "0.26.0") == one  # the next job finds it
    assert cache_folder(cfg, "/models/llama", Layout(tensor=2), "0.27.0") != one  # never another version's
    assert cache_folder(cfg, "/models/other", Layout(tensor=2), "0.26.0") != one  # nor another model's
    assert cache_folder(cfg, "/models/llama", Layout(tensor=1, replicas=4), "0.26.0") != one
    assert cache_env(one) == {"VLLM_CACHE_ROOT": str(one), "TRITON_CACHE_DIR": str(one / "triton")}


def test_off_and_an_explicit_folder():
    off = parse_config({**BASE, "engine": {"compile_cache": "off"}})
    assert cache_folder(off, "/m", Layout(), "1") is None and cache_env(None) == {}
    mine = parse_config({**BASE, "engine": {"compile_cache": "/scratch/me/cache"}})
    assert str(cache_folder(mine, "/m", Layout(), "1")).startswith("/scratch/me/cache/llama-")
    with pytest.raises(ConfigError, match="engine.compile_cache.*absolute folder"):
        parse_config({**BASE, "engine": {"compile_cache": "relative/cache"}})


LOADED = ("(Worker pid=3) INFO 12-02 03:39:18 [decorators.py:322] [backbone] Directly load AOT compilation from "
          "path /c/torch_compile_cache/torch_aot_compile/924/rank_0_0/model\n")
SAVED = ("(Worker pid=3) INFO 12-02 03:39:58 [decorators.py:743] [backbone] saved AOT compiled function to "
         "/c/torch_compile_cache/torch_aot_compile/924/rank_0_0/model\n")
RETRIED = ("(Worker pid=3) WARNING 12-02 04:04:32 [decorators.py:333] [backbone] Compiling model again due to a load "
           "failure from /c/model, reason: 'function' object has no attribute 'finalize_loading'\n")


@pytest.mark.parametrize(("log", "use"), [(LOADED, CacheUse.HIT), (SAVED, CacheUse.MISS), (RETRIED + SAVED, CacheUse.MISS),
                                          ("Starting vLLM server\n", CacheUse.NONE)])
def test_hit_or_miss_from_the_engine_log(log, use):
    assert cache_use(log) is use
