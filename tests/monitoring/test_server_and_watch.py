"""The monitor server (on loopback, port 0) and the watch view over a Gatherer whose replicas are an
httpx.MockTransport stand-in serving the saved vLLM text. No engine."""

from __future__ import annotations

import json

import httpx
import pytest
from monitoring_fakes import Replicas, fake_status, sample
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from hpcserve.cli.watch import render, watch
from hpcserve.monitoring.metrics import Gatherer
from hpcserve.core.net import is_loopback
from hpcserve.monitoring.server import MonitorServer, authorized, dashboard_html


@pytest.fixture
def gatherer(tmp_path):
    (tmp_path / "monitor").mkdir()
    (tmp_path / "monitor" / "n1.jsonl").write_text(json.dumps(sample(1e12)) + "\n")
    client = httpx.Client(transport=httpx.MockTransport(Replicas().handle))
    return Gatherer("d1", client=client, status_fn=fake_status(tmp_path), key_fn=lambda name: None, max_age_s=0.0)


@pytest.fixture
def server(gatherer):
    srv = MonitorServer(gatherer, "127.0.0.1", 0, api_key="s3cret")
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("host,expected", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                           ("0.0.0.0", False), ("10.1.2.3", False), ("login01", False)])
def test_is_loopback(host, expected):
    assert is_loopback(host) is expected


def test_key_checked_in_constant_time_and_only_without_a_key_open():
    assert authorized(None, None) and authorized("Bearer k", "k") and authorized("bearer k", "k")
    assert not authorized(None, "k") and not authorized("Bearer x", "k") and not authorized("Basic k", "k")


def test_dashboard_is_package_data_and_fetches_nothing_from_elsewhere():
    page = dashboard_html().decode()
    assert "api/status" in page and "dataset.testid" in page
    assert "http://" not in page and "https://" not in page and "<script src" not in page


def test_routes(server):
    # The key is asked on loopback too (every user of a login node reaches its loopback).
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.get("/api/status").status_code == 401 and client.get("/metrics").status_code == 401
        client.headers["Authorization"] = "Bearer s3cret"
        assert "hpcserve monitor" in client.get("/").text
        status = client.get("/api/status").json()
        assert [r["up"] for r in status["replicas"]] == [True, False]
        assert status["nodes"][0]["host"] == "n1" and status["deployment"]["status"] == "degraded"
        metrics = client.get("/metrics")
        names = {f.name for f in text_string_to_metric_families(metrics.text)}
        assert {"hpcserve_replica_up", "vllm:num_requests_running", "hpcserve_node_cpu_percent"} <= names
        assert client.get("/nope").status_code == 404
        del client.headers["Authorization"]
        assert client.get("/api/status").status_code == 401 and client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/").status_code == 200  # the page holds no data


def test_a_taken_port_is_a_clear_error(server, gatherer):
    from hpcserve.core.errors import UsageError

    with pytest.raises(UsageError, match="choose another with --port"):
        MonitorServer(gatherer, "127.0.0.1", int(server.url.rsplit(":", 1)[1]))


def test_watch_view_shows_replicas_and_nodes(gatherer):
    gatherer.snapshot()
    console = Console(record=True, width=200)
    console.print(render(gatherer.snapshot()))
    text = console.export_text()
    assert "d1 degraded" in text and "healthy" in text and "DOWN" in text and "ConnectError" in text
    assert "n1" in text and " 50.0 " in text and " 0.5 " in text  # CPU %, engine RSS in GiB


def test_watch_without_deployments(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCSERVE_HOME", str(tmp_path))
    console = Console(record=True, width=120)
    watch(None, interval=0.01, console=console, iterations=1)
    assert "no deployments" in console.export_text()
