"""serve.join refused before anything starts (endpoint/control/joining.py): a deployment that is not there,
one that is no endpoint, one whose endpoint does not serve, a served name already taken there; each is one
message and exit code 2 from `hpcserve up`, with nothing registered or started. And the host's `down` is
refused while another deployment's model is in its data plane. The host is a real data plane process (its
run folder's state.json and admin socket as a controller leaves them), no engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import REPO, free_port, run_cli_here
from router_fixtures import key_file

from hpcserve import api
from hpcserve.core.errors import UsageError
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import Record, forget, list_names, save_record
from hpcserve.core.statuses import RunKind
from hpcserve.endpoint.control.plane_client import Host, Router
from hpcserve.endpoint.protocol import ModelSpec


def config_file(folder: Path, name: str, **serve) -> Path:
    data = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    data.update(name=name, results_dir=str(folder / "results"))
    data["serve"] = {**data["serve"], "port": free_port(), **serve}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def host_record(folder: Path, name: str, kind: RunKind, router: Router | None = None) -> Record:
    """A registered deployment's run folder as its controller leaves it: its config, its state.json."""
    run_dir = folder / name
    run_dir.mkdir(exist_ok=True)
    port = {"port": router.port} if router is not None else {}
    (run_dir / "config.yaml").write_text(config_file(folder, name, **port).read_text())
    endpoint = {"url": router.url, "pid": router.pid} if router is not None else {}
    (run_dir / "state.json").write_text(json.dumps({"status": "ready", "endpoint": endpoint}))
    record = Record(name, "local", str(run_dir), kind=kind)
    save_record(record)
    return record


@pytest.fixture()
def host(tmp_path, hpcserve_home):
    """A serving endpoint "t-host" of model tiny: a real data plane at its run folder's admin socket."""
    run_dir = tmp_path / "t-host"
    router = Router("127.0.0.1", free_port(), key_file(tmp_path), tmp_path / "plane.log", model="tiny",
                    admin_socket=RunPaths(run_dir).router_admin)
    router.start([])
    try:
        yield host_record(tmp_path, "t-host", RunKind.ENDPOINT, router), router
    finally:
        router.stop()
        router.close()
        forget("t-host")


def refused_up(tmp_path: Path, name: str, join: str, served: str = "tiny-b") -> str:
    config = config_file(tmp_path, name, join=join)
    data = yaml.safe_load(config.read_text())
    data["model"]["served_name"] = served
    config.write_text(yaml.safe_dump(data))
    before = set(list_names())
    result = run_cli_here("up", str(config))
    assert result.returncode == 2, result.stdout + result.stderr
    assert set(list_names()) == before  # nothing registered
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").rglob("state.json"))
    return " ".join((result.stdout + result.stderr).split())


def test_a_join_to_a_deployment_that_is_not_there_is_refused(tmp_path, hpcserve_home):
    assert "serve.join 't-absent': no deployment of yours by that name" in refused_up(tmp_path, "t-a", "t-absent")


def test_a_join_to_a_deployment_without_an_endpoint_is_refused(tmp_path, hpcserve_home):
    host_record(tmp_path, "t-driver", RunKind.DRIVER)
    try:
        assert "serve.join 't-driver': that deployment has no endpoint" in refused_up(tmp_path, "t-b", "t-driver")
    finally:
        forget("t-driver")


def test_a_join_to_an_endpoint_that_does_not_serve_is_refused(tmp_path, hpcserve_home):
    host_record(tmp_path, "t-stopped", RunKind.ENDPOINT)
    try:
        assert "its endpoint does not serve now" in refused_up(tmp_path, "t-c", "t-stopped")
    finally:
        forget("t-stopped")


def test_a_served_name_already_there_is_refused(tmp_path, host):
    said = refused_up(tmp_path, "t-d", "t-host", served="tiny")
    assert "a model named 'tiny' is served there already (models: tiny)" in said


def test_the_hosts_down_is_refused_while_another_model_is_in_it(tmp_path, host):
    _, router = host
    guest = Router(router.host, router.port, None, tmp_path / "guest.log", admin_socket=router.admin_socket,
                   joined=Host(ModelSpec("tiny-b"), lambda: router.pid))
    guest.start([])
    try:
        with pytest.raises(UsageError, match=r"t-host serves the models of deployments that joined it: tiny-b\. "
                                             r"`hpcserve down` those first"):
            api.down("t-host")
        assert router.alive() and "t-host" in list_names()  # refused before anything stopped
    finally:
        guest.stop()
        guest.close()
    assert router.models().names() == ["tiny"]
