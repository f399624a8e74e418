"""Several models behind one URL (endpoint/dataplane/rooms.py): a real data plane process (two workers,
as on a login node) in front of stand-in engines, its own model "alpha" and a second model "beta" that
joins over the admin socket the way a joined deployment's controller does it (plane_client.Router with
joined=Host). Requests go to the model they name; /v1/models lists each with its state; a model not
there gets a 404 naming those that are; a model joins and leaves while the other serves without one
failed request; a stream migrates only among its own model's replicas."""

from __future__ import annotations

import threading

import httpx
import pytest
from helpers import free_port
from router_fixtures import headers, key_file, run_load, start_stubs, stop
from test_migration import client_body
from test_streams import Engines, client_stream

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.control.plane_client import Host, Router, RouterError
from hpcserve.endpoint.dataplane import migration as m
from hpcserve.endpoint.protocol import ModelSpec, ModelState
from hpcserve.testing.harness import wait_until

HTTP = httpx.Client(timeout=30, trust_env=False)


def joined(host: Router, name: str, directory, policy: Routing = Routing.LEAST_LOADED) -> Router:
    """A second model's Router, as a joined deployment's controller makes it (joining.joined_router)."""
    return Router(host.host, host.port, key_file(directory), directory / f"{name}.log", model=name, policy=policy,
                  admin_socket=host.admin_socket, hold_s=30.0,
                  joined=Host(ModelSpec(name, str(policy), 30.0), lambda: host.pid))


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models")
    stubs = start_stubs(["a1", "a2", "b1"], directory, token_delay_ms=0)
    alpha = Router("127.0.0.1", free_port(), key_file(directory), directory / "plane.log", model="alpha",
                   admin_socket=directory / "plane" / "admin.sock", workers=2)
    beta = joined(alpha, "beta", directory)
    try:
        alpha.start([stubs[0][1], stubs[1][1]])
        beta.start([stubs[2][1]])
        yield alpha, beta, directory
    finally:
        beta.stop()
        alpha.stop()
        for router in (alpha, beta):
            router.close()
        for proc, _ in stubs:
            stop(proc)


def complete(url: str, model: str | None) -> httpx.Response:
    body = {"prompt": "Hello", "max_tokens": 4} | ({"model": model} if model is not None else {})
    return HTTP.post(f"{url}/v1/completions", json=body, headers=headers())


def test_each_request_goes_to_the_model_it_names(endpoint):
    alpha, beta, _ = endpoint
    by = {model: {complete(alpha.url, model).headers["x-backend"] for _ in range(12)} for model in ("alpha", "beta")}
    assert by == {"alpha": {"a1", "a2"}, "beta": {"b1"}}
    assert beta.url == alpha.url  # one URL
    assert [b.url for b in beta.backends()] == [endpoint[1].desired()[0].url]  # the admin calls are beta's alone
    assert len(alpha.backends()) == 2


def test_models_lists_every_model_with_its_state(endpoint):
    alpha, _, directory = endpoint
    gamma = joined(alpha, "gamma", directory)
    gamma.start([])  # no replica yet: its deployment is starting
    try:
        listed = HTTP.get(f"{alpha.url}/v1/models", headers=headers()).json()
        assert listed["object"] == "list"
        assert [(c["id"], c["object"], c["owned_by"], c["state"], c["replicas"]) for c in listed["data"]] == [
            ("alpha", "model", "hpcserve", "serving", 2), ("beta", "model", "hpcserve", "serving", 1),
            ("gamma", "model", "hpcserve", "starting", 0)]
        one = HTTP.get(f"{alpha.url}/v1/models/beta", headers=headers())
        assert (one.status_code, one.json()["id"]) == (200, "beta")
        assert [(r.name, r.state, r.own) for r in alpha.models().models] == [
            ("alpha", ModelState.SERVING, True), ("beta", ModelState.SERVING, False),
            ("gamma", ModelState.STARTING, False)]
        assert HTTP.get(f"{alpha.url}/v1/models").status_code == 401  # the key still guards it
    finally:
        gamma.stop()
        gamma.close()
    assert alpha.models().names() == ["alpha", "beta"]


def test_a_model_not_there_gets_a_404_naming_the_models_there_are(endpoint):
    alpha, _, _ = endpoint
    unknown = complete(alpha.url, "llama-70b")
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert error["code"] == "model_not_found" and "'llama-70b'" in error["message"]
    assert "alpha, beta" in error["message"]
    nameless = complete(alpha.url, None)  # two models: the request must say which
    assert nameless.status_code == 400 and "alpha, beta" in nameless.json()["error"]["message"]
    assert HTTP.get(f"{alpha.url}/v1/models/llama-70b", headers=headers()).status_code == 404


def test_the_admin_api_is_scoped_by_model(endpoint):
    alpha, _, directory = endpoint
    stray = Router(alpha.host, alpha.port, None, directory / "stray.log", admin_socket=alpha.admin_socket,
                   joined=Host(ModelSpec("nowhere"), lambda: alpha.pid))
    stray.pid = alpha.pid
    with pytest.raises(RouterError, match="HTTP 404.*no model 'nowhere' here; models: alpha, beta"):
        stray.backends()
    with pytest.raises(RouterError, match="HTTP 409.*alpha is this data plane's own model"):
        stray._admin_call("DELETE", "/models/alpha")
    with pytest.raises(RouterError, match="HTTP 409.*cannot join under its name"):
        stray._admin_call("PUT", "/models/alpha", json={})
    stray.close()


def test_a_model_joins_and_leaves_while_the_other_serves_without_a_failed_request(endpoint, tmp_path):
    """Under steady traffic to alpha, gamma joins (its requests served), then leaves (404 from then on, and a
    request it held gets 404 at once): not one of alpha's requests fails, and both workers knew of gamma."""
    alpha, _, _ = endpoint
    stubs = start_stubs(["g1"], tmp_path, token_delay_ms=0)
    done = threading.Event()
    threads, load = run_load(alpha.url, "alpha", done, workers=4, max_tokens=4)
    gamma = joined(alpha, "gamma", tmp_path)
    try:
        wait_until(lambda: load.ok >= 20, 30, "alpha's load under way")
        gamma.start([stubs[0][1]])
        served = [complete(alpha.url, "gamma") for _ in range(8)]  # new connections: either worker
        assert {(r.status_code, r.headers.get("x-backend")) for r in served} == {(200, "g1")}
        gamma.set_backends([])  # its replica goes: a request for gamma is held ...
        held: dict = {}
        waiter = threading.Thread(target=lambda: held.update(response=complete(alpha.url, "gamma")))
        waiter.start()
        wait_until(lambda: gamma.backends_json()["held"] >= 1, 10, "gamma's request held")
        assert alpha.backends_json()["held"] == 0  # held counts are each model's own
        gamma.stop()  # ... and gets 404 when gamma leaves, not its 30 s hold's 503
        waiter.join(10)
        assert not waiter.is_alive() and held["response"].status_code == 404
        assert complete(alpha.url, "gamma").status_code == 404
        ok_before = load.ok
        wait_until(lambda: load.ok >= ok_before + 20, 30, "alpha serving on after gamma left")
    finally:
        done.set()
        for thread in threads:
            thread.join(30)
        gamma.close()
        stop(stubs[0][0])
    assert load.failed == []
    assert set(load.served_by) == {"a1", "a2"}


@pytest.fixture()
def streaming(tmp_path):
    """alpha with one streaming engine, beta with two: a stream of alpha's has no other replica of alpha."""
    alpha_engines, beta_engines = Engines(), Engines()
    alpha = Router("127.0.0.1", free_port(), key_file(tmp_path), tmp_path / "plane.log", model="alpha",
                   policy=Routing.ROUND_ROBIN, admin_socket=tmp_path / "plane" / "admin.sock",
                   options=["--failed-s", "1"])  # the dropped replica is back in a second
    beta = joined(alpha, "beta", tmp_path, Routing.ROUND_ROBIN)
    try:
        alpha.start(alpha_engines.urls[:1])
        beta.start(beta_engines.urls)
        yield alpha, beta, alpha_engines, beta_engines
    finally:
        beta.stop()
        alpha.stop()
        alpha.close()
        beta.close()
        alpha_engines.close()
        beta_engines.close()


def test_a_stream_migrates_only_among_its_own_models_replicas(streaming):
    """alpha's only replica drops the stream: beta's two idle replicas serve the same kind of request, but
    another model's replica must not continue alpha's stream; it is cut, and the refusal is on record."""
    alpha, beta, alpha_engines, beta_engines = streaming
    alpha_engines.failure, alpha_engines.after = "drop", 5
    stream = client_stream(alpha, m.Kind.COMPLETION, {**client_body(m.Kind.COMPLETION), "model": "alpha"})
    assert stream.endswith(b"<cut>")
    assert beta_engines.served == []
    moved = alpha.migrations(0)
    assert [(x["to"], x["reason"]) for x in moved] == [(None, "no other replica can take it")]
    assert alpha.migrations(moved[-1]["time"]) == []  # only those after the time asked (the host's, unscoped, too)
    assert beta.migrations(0) == []
    # With a second replica of its own, the same failure continues there.
    alpha.add(alpha_engines.urls[1])
    wait_until(lambda: all(b.healthy for b in alpha.backends()), 10, "alpha's replicas both taking requests")
    alpha_engines.failure, alpha_engines.after = "drop", 5
    whole = client_stream(alpha, m.Kind.COMPLETION, {**client_body(m.Kind.COMPLETION), "model": "alpha"})
    assert b"data: [DONE]" in whole and beta_engines.served == []
    assert [x["to"] in alpha_engines.urls for x in alpha.migrations(0)[1:]] == [True]
