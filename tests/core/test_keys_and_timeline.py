"""Pure pieces of the run folder: every deployment's API key, where it is found and removed, and where `up`'s
time went."""

from __future__ import annotations

import os
import stat

import pytest

from hpcserve.benchmark.bench import unauthorized_message
from hpcserve.core.errors import UnsafePathError, UsageError
from hpcserve.core.files import create_secret, write_secret
from hpcserve.core.folders import private_dir
from hpcserve.core.keys import ApiKey, choose_key, handed_on, key_variable, read_api_key, remove_secrets, store_key
from hpcserve.core.paths import RunPaths
from hpcserve.core.timeline import breakdown_line, stage_breakdown


def mode_of(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_generated_key_comes_from_its_file(tmp_path):
    paths = RunPaths(tmp_path)
    create_secret(paths.api_key, "generated-key\n")  # mode 0600: read_api_key refuses a key others may read
    paths.api_key_source.write_text(f"{paths.api_key}\n")
    assert read_api_key(tmp_path, environ={}) == "generated-key"


def test_key_from_the_variable_up_used(tmp_path):
    RunPaths(tmp_path).api_key_source.write_text("$MY_KEY\n")
    assert key_variable(tmp_path) == "MY_KEY"
    assert read_api_key(tmp_path, environ={"MY_KEY": "from-env"}) == "from-env"


def test_unset_variable_says_which_to_export(tmp_path):
    RunPaths(tmp_path).api_key_source.write_text("$MY_KEY\n")
    with pytest.raises(UsageError, match=r"\$MY_KEY .*export MY_KEY"):
        read_api_key(tmp_path, environ={})


def test_no_key_configured(tmp_path):
    RunPaths(tmp_path).api_key_source.write_text("none\n")
    assert read_api_key(tmp_path, environ={}) is None
    assert read_api_key(tmp_path / "missing", environ={}) is None


def test_every_deployment_has_a_key_unless_it_says_so_loudly():
    assert choose_key("MY_KEY", False, {"MY_KEY": "mine"}) == ApiKey("mine", "$MY_KEY")
    generated = choose_key("MY_KEY", False, {"MY_KEY": ""})
    assert generated.source == "generated" and len(generated.value) >= 40
    assert choose_key(None, False, {}).source == "generated"  # no variable named: generated as well
    assert choose_key(None, True, {}) == ApiKey(None, "none")


def test_a_run_gets_its_own_0600_copy_and_down_removes_every_copy(tmp_path):
    endpoint = RunPaths(private_dir(tmp_path / "ep", fresh=True))
    store_key(endpoint.root, ApiKey("k1", "generated"))
    assert mode_of(endpoint.api_key) == 0o600 and endpoint.api_key_source.read_text() == f"{endpoint.api_key}\n"
    member = RunPaths(private_dir(endpoint.members / "logs" / "ep-m0-7", fresh=True))
    store_key(member.root, handed_on(endpoint.root, "k1"))
    assert read_api_key(member.root, environ={}) == "k1"
    assert member.api_key_source.read_text().strip() == str(endpoint.api_key)
    write_secret(endpoint.router_key, "k1")
    create_secret(member.ray_token, "t")
    removed = remove_secrets(endpoint.root)
    assert set(removed) == {endpoint.api_key, endpoint.router_key, member.api_key, member.ray_token}
    assert not any(p.exists() for p in removed)


def test_a_planted_key_file_is_refused(tmp_path):
    paths = RunPaths(tmp_path)
    paths.api_key.write_text("theirs")
    paths.api_key.chmod(0o644)
    with pytest.raises(UnsafePathError):
        read_api_key(tmp_path, environ={})


def test_unauthorized_message_names_the_option():
    assert "--api-key-env NAME" in unauthorized_message("http://h:1/v1/models", 401, None)
    assert "refused the API key" in unauthorized_message("http://h:1", 403, "k")


def test_stage_breakdown_with_queue_and_overlap():
    timeline = [{"stage": "ray", "event": "started", "time": 105.0}, {"stage": "ray", "event": "done", "time": 113.0},
                {"stage": "health", "event": "started", "time": 113.0},
                {"stage": "engine", "event": "started", "time": 114.0},
                {"stage": "health", "event": "done", "time": 116.0},
                {"stage": "engine", "event": "done", "time": 180.0}, {"stage": "ready", "event": "started", "time": 180.0}]
    stages = stage_breakdown(timeline, submitted=100.0, job_started=104.0)
    assert stages["queue"] == {"start_s": 0.0, "seconds": 4.0}
    assert stages["engine"] == {"start_s": 14.0, "seconds": 66.0}
    assert stages["health"]["seconds"] == 3.0
    line = breakdown_line(stages)
    assert line.startswith("queue 4.0 s") and "engine 66.0 s (from +14.0 s)" in line and line.endswith("ready at +80.0 s")


def test_a_running_stage_has_no_duration_yet():
    stages = stage_breakdown([{"stage": "engine", "event": "started", "time": 3.0}], submitted=0.0)
    assert stages == {"engine": {"start_s": 3.0, "seconds": None}}
    assert breakdown_line(stages) == "engine running (from +3.0 s)"
