"""Bad input, generated: thousands of deployment files shaped like the schema (every field given a right
value, a wrong one or junk; unknown keys; missing ones) and raw YAML text and bytes. The loader either
returns a config or raises ConfigError whose every line names the field at fault: never a traceback.

Derandomized (the same examples every run, so a failure is reproducible and CI never flakes); raise
HPCSERVE_FUZZ_EXAMPLES to search further by hand."""

from __future__ import annotations

import os
import re
import types
from typing import Literal, Union, get_args, get_origin

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from hpcserve.core.config import DeploymentConfig, load_config, parse_config
from hpcserve.core.errors import ConfigError

EXAMPLES = int(os.environ.get("HPCSERVE_FUZZ_EXAMPLES", "2000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

WORDS = ["auto", "local", "slurm", "0.0.0.0", "127.0.0.1", "::1", "1:00:00", "30", "1h", "builtin:tiny-llama",
         "builtin:x", "--api-key", "--api_key=s", "--api-k", "HF_TOKEN", "venv", "apptainer", "pyxis", "ray", "mp",
         "float32", "fp8", "llama-3.1-70b", "/nonexistent", "UNLIMITED", "HPCSERVE_API_KEY", "a" * 80, "x\ny"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 70000), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(WORDS))
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=8) | st.integers(0, 3), inner, max_size=3), max_leaves=6)
ENV_NAMES = st.sampled_from(["HF_TOKEN", "WANDB_API_KEY", "HF_TOKEN_PATH", "TOKENIZERS_PARALLELISM",
                             "VLLM_CPU_KVCACHE_SPACE", "DB_PASSWORD"]) | st.text(max_size=10)


def for_annotation(annotation) -> st.SearchStrategy:
    """A right value for a field of this type, or a wrong one."""
    origin, args = get_origin(annotation), get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_dicts(annotation) | JUNK
    if origin in (Union, types.UnionType):
        return st.one_of(*(for_annotation(a) for a in args))
    if origin is Literal:
        return st.sampled_from(args) | SCALARS
    if origin is list:
        return st.lists(for_annotation(args[0]), max_size=3) | JUNK
    if origin is dict:
        return st.dictionaries(ENV_NAMES, st.text(max_size=8) | SCALARS, max_size=3) | JUNK
    plain = {bool: st.booleans(), int: st.integers(-2, 70000), float: st.floats(-1, 1e6), str: st.sampled_from(WORDS),
             type(None): st.none()}
    return (plain[annotation] | SCALARS) if annotation in plain else JUNK


def model_dicts(model: type[BaseModel]) -> st.SearchStrategy:
    """A mapping shaped like `model`: any subset of its fields, sometimes a key it does not know."""
    fields = st.fixed_dictionaries({}, optional={name: for_annotation(field.annotation)
                                                 for name, field in model.model_fields.items()})
    unknown = st.dictionaries(st.sampled_from(["modle", "gpu", "nodes_per_replica", "api-key"]), SCALARS, max_size=1)
    return st.builds(lambda known, extra: {**known, **extra}, fields, unknown)


def field_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every field's dotted path (cluster.scheduler, serve.api_key_env, ...) and every field's name."""
    paths = set()
    for name, field in model.model_fields.items():
        paths |= {prefix + name, name}
        for candidate in get_args(field.annotation) + (field.annotation,):
            inner = get_args(candidate)[0] if get_origin(candidate) is list else candidate
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                paths |= field_paths(inner, prefix + name + ".")
    return paths


PATHS = sorted(field_paths(DeploymentConfig), key=len, reverse=True)
# A field named whole: a dotted path or a field's name, not inside a longer word or path ('env' is not in
# 'environment', 'port' not in 'portable' or 'x.port'); a path may go on into a list index or an unknown key
# under it ('replica_groups.0', 'serve.modle').
NAMES_A_FIELD = re.compile(r"(?<![\w.-])(?:%s)(?![\w-])" % "|".join(map(re.escape, PATHS)))


def assert_names_a_field(error: ConfigError) -> None:
    text = str(error)
    assert "Traceback (most recent call last)" not in text  # a config may name itself Traceback
    lines = [line.removeprefix("  - ") for line in text.split(": ", 1)[1].splitlines() if line.strip()]
    for line in lines:
        assert NAMES_A_FIELD.search(line), f"an error line names no field: {line!r}"


def test_the_check_wants_a_whole_field_name_or_path():
    for line in ("'engine.env' = 1: Input should be a valid dictionary", "'replica_groups.0' = 1: bad",
                 "unknown key 'serve.modle'. Valid keys here: host, port", "'name' is required: add it",
                 "it needs cluster.scheduler 'slurm' and serve.router true"):
        assert_names_a_field(ConfigError(f"config: {line}"))
    for line in ("'environment' = 1: Input should be a valid dictionary", "'hostname' = 'x': bad",
                 "'portable' = 1: Input should be a valid integer", "unknown key 'modle'",
                 "Input should be a valid string", "'model_path' is required"):
        with pytest.raises(AssertionError, match="an error line names no field"):
            assert_names_a_field(ConfigError(f"config: {line}"))


VALID_BASE = {"name": "fuzz", "model": {"path": "builtin:tiny-llama"}}
CONFIGS = model_dicts(DeploymentConfig) | model_dicts(DeploymentConfig).map(lambda changes: {**VALID_BASE, **changes})


@FUZZ
@given(CONFIGS)
def test_generated_configs_load_or_name_the_field(raw):
    """Half of them start from a valid config, so that the validators comparing fields (layouts, groups,
    the key's opt-out) are reached, not only the per-field checks."""
    try:
        parse_config(raw)
    except ConfigError as exc:
        assert_names_a_field(exc)


@settings(max_examples=max(EXAMPLES // 10, 50), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.text(max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("latin-1")) | st.binary(max_size=200))
def test_any_file_content_loads_or_is_a_config_error(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("fuzz") / "config.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", errors="surrogatepass")
    try:
        load_config(path)
    except ConfigError as exc:
        assert "Traceback" not in str(exc) and str(path) in str(exc)


def test_a_deeply_nested_or_binary_file_is_a_config_error(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 5000 + "]" * 5000)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: \xff\xfe\x00x\n")
    for path in (deep, binary):
        with pytest.raises(ConfigError, match=str(path)):
            load_config(path)
