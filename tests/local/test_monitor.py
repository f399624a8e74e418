"""For real: `hpcserve monitor` the shared local deployment (tests/local/conftest.py), read its /metrics and
/api/status, and load the dashboard in headless Chromium (Debian's chromium driven by playwright;
screenshot in artifacts/dashboard.png)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from helpers import REPO, free_port
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from hpcserve.testing.harness import wait_until

pytestmark = pytest.mark.slow
NAME = "t-local"  # tests/local/conftest.py
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def deployment(local_deployment):
    if local_deployment["up"].returncode != 0:
        pytest.fail(f"hpcserve up failed:\n{local_deployment['up'].stdout}\n{local_deployment['up'].stderr}")
    return local_deployment


@pytest.fixture(scope="module")
def monitor(deployment):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hpcserve.cli.monitor", NAME, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"

    def serving() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"hpcserve monitor exited {proc.returncode}: {proc.stdout.read()}")
        try:
            return httpx.get(url + "/", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(serving, 30, "hpcserve monitor answers /")
        yield url
    finally:
        os.kill(proc.pid, signal.SIGTERM)  # our own child, by PID
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium, driven by playwright. Installs nothing: skips when either is missing."""
    if not CHROMIUM.exists():
        pytest.skip("the dashboard test needs Debian's chromium at /usr/bin/chromium: apt-get install -y chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the dashboard test needs `pip install playwright`")
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def key_header(deployment: dict) -> dict[str, str]:
    """The monitor asks for the deployment's key on loopback too."""
    return {"Authorization": f"Bearer {deployment['key']}"}


def families(url: str, deployment: dict) -> dict[str, list]:
    text = httpx.get(url + "/metrics", headers=key_header(deployment), timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_metrics_show_the_replica_up_and_vllm_metrics_with_labels(monitor, deployment):
    fams = families(monitor, deployment)
    up = fams["hpcserve_replica_up"]
    assert [(s.labels["deployment"], s.labels["replica"], s.value) for s in up] == [(NAME, "0", 1.0)]
    running = fams["vllm:num_requests_running"]
    assert running and running[0].labels["deployment"] == NAME and running[0].labels["replica"] == "0"
    assert running[0].labels["model_name"] == "tiny"
    generated = [s.value for s in fams["vllm:generation_tokens"] if s.name.endswith("_total")]
    assert generated and generated[0] > 0  # the ready check's completion
    assert "vllm:kv_cache_usage_perc" in fams
    assert fams["hpcserve_node_cpu_percent"] and fams["hpcserve_engine_rss_bytes"][0].value > 0


def test_api_status_and_watch_view(monitor, deployment):
    status = httpx.get(monitor + "/api/status", headers=key_header(deployment), timeout=10).json()
    assert status["deployment"]["status"] == "ready"
    assert [(r["index"], r["up"], r["healthy"]) for r in status["replicas"]] == [(0, True, True)]
    assert status["nodes"] and not status["nodes"][0]["stale"]

    from hpcserve.cli.watch import watch

    console = Console(record=True, width=200)
    watch(NAME, interval=0.1, console=console, iterations=1)
    text = console.export_text()
    assert f"{NAME} ready" in text and "healthy" in text and status["nodes"][0]["host"] in text


def load(deployment: dict, stop: threading.Event) -> None:
    """Completions one after another, so that tokens/s is above zero while the dashboard watches."""
    headers = {"Authorization": f"Bearer {deployment['key']}"}
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 48, "ignore_eos": True}
    while not stop.is_set():
        httpx.post(deployment["url"] + "/v1/completions", json=body, headers=headers, timeout=60)


def test_dashboard_shows_the_healthy_replica(monitor, deployment, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 950})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    stop = threading.Event()
    loader = threading.Thread(target=load, args=(deployment, stop), daemon=True)
    loader.start()
    try:
        page.goto(monitor + f"/#key={deployment['key']}")
        row = page.wait_for_selector('[data-testid="replica-0"]', timeout=30_000)
        replica_url = httpx.get(monitor + "/api/status", headers=key_header(deployment),
                                timeout=10).json()["replicas"][0]["url"]
        assert replica_url != deployment["url"]  # the replica behind the endpoint, not the endpoint
        assert "healthy" in row.inner_text() and replica_url in row.inner_text()
        page.wait_for_function(  # the generated tok/s cell, once two scrapes saw the counter grow
            "() => parseFloat(document.querySelector('[data-testid=\"replica-0\"]').cells[8].textContent) > 0",
            timeout=30_000)
        page.wait_for_timeout(4000)  # a few more polls, so the tokens chart has a line
        (REPO / "artifacts").mkdir(exist_ok=True)
        page.screenshot(path=str(REPO / "artifacts" / "dashboard.png"), full_page=True)
        assert page.inner_text("#status") == "ready"
        assert page.locator("#nodes tbody tr").count() >= 1
    finally:
        stop.set()
        loader.join(timeout=90)
        page.close()
    assert not errors, errors
