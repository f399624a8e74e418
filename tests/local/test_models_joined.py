"""Two models behind one endpoint on real vLLM (CPU): a second deployment of the builtin tiny model, served
as "tiny-b", joins the shared local deployment (t-local, "tiny") with serve.join, through `hpcserve up` as a
user runs it. One new engine starts; the first is the session's, reused. Bad joins are refused before
anything starts (exit code 2, one message); both models answer on one URL; /v1/models lists them with
their state; the host's `down` is refused while tiny-b is in it; `down` of the joined deployment under
traffic to tiny costs tiny not one request, and tiny-b is gone from the URL afterwards. Runs before
test_zz_down, which stops t-local."""

from __future__ import annotations

import threading

import httpx
import pytest
from helpers import free_port, run_cli, write_config

pytestmark = pytest.mark.slow

JOINED = "t-joined"


def models(url: str, key: str) -> list[tuple[str, str]]:
    listed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
    return [(card["id"], card["state"]) for card in listed["data"]]


def complete(url: str, key: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4,
                                                     "temperature": 0},
                      headers={"Authorization": f"Bearer {key}"}, timeout=120)


def load(url: str, key: str, model: str, done: threading.Event, counts: dict) -> threading.Thread:
    """Completions of model one after another until done: counts["ok"], and each failure's text."""
    def loop() -> None:
        while not done.is_set():
            try:
                answer = complete(url, key, model)
                failure = None if answer.status_code == 200 else f"HTTP {answer.status_code}: {answer.text[:200]}"
            except httpx.HTTPError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            if failure:
                counts["failed"].append(failure)
            else:
                counts["ok"] += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def joining(local_deployment, tmp_path, name: str, served: str, join: str):
    return write_config(tmp_path / f"{name}.yaml", local_deployment["config"], name=name,
                        serve={"join": join, "port": free_port()}, model={"served_name": served},
                        results_dir=str(tmp_path / "results"))


def test_two_models_behind_one_endpoint_and_one_leaves_without_cutting_the_other(local_deployment, tmp_path):
    assert local_deployment["up"].returncode == 0, local_deployment["up"].stderr
    url, key, host = local_deployment["url"], local_deployment["key"], local_deployment["name"]
    for name, served, join, says in (("t-nowhere", "tiny-b", "t-absent", "no deployment of yours by that name"),
                                     ("t-clash", "tiny", host, "a model named 'tiny' is served there already")):
        refused = run_cli("up", str(joining(local_deployment, tmp_path, name, served, join)), "--timeout", "60")
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr
        assert run_cli("status", name).returncode == 2  # nothing registered, nothing started
    up = run_cli("up", str(joining(local_deployment, tmp_path, JOINED, "tiny-b", host)), "--timeout", "600")
    try:
        assert up.returncode == 0, up.stderr
        assert models(url, key) == [("tiny", "serving"), ("tiny-b", "serving")]
        for model in ("tiny", "tiny-b"):
            answer = complete(url, key, model)
            assert answer.status_code == 200 and answer.json()["model"] == model, answer.text
        unknown = complete(url, key, "llama")
        assert unknown.status_code == 404 and "tiny, tiny-b" in unknown.json()["error"]["message"]
        refused = run_cli("down", host)
        assert refused.returncode == 2 and f"tiny-b ({JOINED})" in refused.stderr, refused.stderr
        status = run_cli("status", JOINED)
        assert "models: tiny (serving, 1 replica(s)), tiny-b (serving, 1 replica(s))" in status.stdout, status.stdout
        done, counts = threading.Event(), {"ok": 0, "failed": []}
        threads = [load(url, key, "tiny", done, counts) for _ in range(2)]
        try:
            down = run_cli("down", JOINED)
            assert down.returncode == 0, down.stderr
            ok = counts["ok"]
            while counts["ok"] < ok + 3 and not counts["failed"]:  # tiny serves on after tiny-b left
                done.wait(0.2)
        finally:
            done.set()
            for thread in threads:
                thread.join(120)
        assert counts["failed"] == [] and counts["ok"] > 3
        assert models(url, key) == [("tiny", "serving")]
        assert complete(url, key, "tiny-b").status_code == 404
    finally:
        run_cli("down", JOINED)
