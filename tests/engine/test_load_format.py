"""engine.load_format: auto takes the fastest loader installed on the node; the user's word wins."""

from __future__ import annotations

import pytest

from hpcserve.core.config import parse_config
from hpcserve.core.errors import ConfigError
from hpcserve.engine.load_format import PREFERENCE, choose, load_format_args


def test_auto_takes_the_fastest_installed_loader_on_gpus():
    everything = choose("auto", [], on_gpu=True, available=lambda module: True)
    assert everything.load_format == PREFERENCE[0][0] and "fastest" in everything.reason
    second = choose("auto", [], on_gpu=True, available=lambda module: module == PREFERENCE[1][1])
    assert second.load_format == PREFERENCE[1][0]
    none = choose("auto", [], on_gpu=True, available=lambda module: False)
    assert none.load_format is None and "default loader" in none.reason and load_format_args(none) == []


def test_cpu_explicit_setting_and_engine_args():
    assert choose("auto", [], on_gpu=False, available=lambda module: True).load_format is None
    assert load_format_args(choose("runai_streamer", [], on_gpu=True)) == ["--load-format", "runai_streamer"]
    mine = choose("auto", ["--load-format=dummy"], on_gpu=True, available=lambda module: True)
    assert mine.load_format is None and "engine.args" in mine.reason


def test_a_bad_value_names_the_field():
    with pytest.raises(ConfigError, match="engine.load_format"):
        parse_config({"name": "x", "model": {"path": "/m"}, "engine": {"load_format": "Fast Loader!"}})
