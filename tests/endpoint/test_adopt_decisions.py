"""Adoption's decisions, pure: what a new controller does with each member and backend its lost
predecessor left running, and which config differences refuse an adoption."""

from __future__ import annotations

from pathlib import Path

import yaml

from hpcserve.core.config import DeploymentConfig, config_differences
from hpcserve.core.files import read_json, write_json, write_secret
from hpcserve.core.statuses import Adoption, MemberStatus
from hpcserve.endpoint.control.decisions import adopt_member, backend_changes

REPLICAS = Path(__file__).parents[1] / "cluster" / "sandbox-replicas.yaml"


def test_a_serving_member_whose_job_runs_and_replicas_answer_is_adopted_untouched():
    verdict, reason = adopt_member(MemberStatus.SERVING, gone=None, probe_error=None)
    assert verdict is Adoption.ADOPT and "real completion" in reason


def test_a_serving_member_that_fails_the_completion_is_dropped_and_one_whose_job_ended_is_lost():
    verdict, reason = adopt_member(MemberStatus.SERVING, None, "http://n1:8301: ReadTimeout")
    assert verdict is Adoption.DROP and "ReadTimeout" in reason
    verdict, reason = adopt_member(MemberStatus.SERVING, "the Slurm job ended: NODE_FAIL", None)
    assert verdict is Adoption.LOST and "NODE_FAIL" in reason


def test_a_starting_member_is_watched_whatever_its_job_does():
    assert adopt_member(MemberStatus.LAUNCHING, None, None)[0] is Adoption.WATCH
    assert adopt_member(MemberStatus.LAUNCHING, "the Slurm job ended", None)[0] is Adoption.WATCH


def test_a_drain_or_stop_in_progress_is_finished_and_history_is_kept():
    assert adopt_member(MemberStatus.DRAINING, None, None)[0] is Adoption.FINISH
    assert adopt_member(MemberStatus.STOPPING, "the Slurm job ended: CANCELLED", None)[0] is Adoption.FINISH
    assert adopt_member(MemberStatus.GONE, None, None) == (Adoption.KEEP, "")
    assert adopt_member(MemberStatus.FAILED, "the Slurm job ended", None) == (Adoption.KEEP, "")


def test_the_controller_owns_the_routers_backend_list():
    remove, add = backend_changes(["http://a:1/", "http://stranger:9", "http://b:2"], ["http://a:1", "http://c:3"])
    assert remove == ["http://b:2", "http://stranger:9"] and add == ["http://c:3"]
    assert backend_changes(["http://a:1"], ["http://a:1/"]) == ([], [])


def test_config_differences_name_each_field_with_both_values():
    running = DeploymentConfig(**yaml.safe_load(REPLICAS.read_text()))
    assert config_differences(running, running) == []
    given = running.model_copy(update={"serve": running.serve.model_copy(update={"port": 8301})})
    assert config_differences(running, given) == ["serve.port: 8300 running, 8301 given"]


def test_files_are_replaced_whole_and_secrets_stay_private(tmp_path):
    path = tmp_path / "state.json"
    write_json(path, {"members": [1]})
    write_json(path, {"members": [1, 2]})
    assert read_json(path) == {"members": [1, 2]} and [p.name for p in tmp_path.iterdir()] == ["state.json"]
    secret = write_secret(tmp_path / "key", "k1")
    write_secret(secret, "k2")
    assert secret.read_text() == "k2" and secret.stat().st_mode & 0o777 == 0o600
