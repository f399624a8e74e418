"""Sleep instead of stop (engine.sleep_mode): the pure decisions, the config's checks, the engine's command
line and environment, the data plane keeping vLLM's development routes from clients. End to end with
stand-in members: test_engine_sleep_standin.py (sleeps and wakes), test_sleep_standin.py (404: stops)."""

from __future__ import annotations

import pytest

from hpcserve.core.config import parse_config
from hpcserve.core.errors import ConfigError
from hpcserve.endpoint.control.decisions import (
    decide_idle,
    decide_release,
    decide_wake_how,
)
from hpcserve.endpoint.control.members import member_config
from hpcserve.endpoint.dataplane.wire import engine_only
from hpcserve.engine.args import EngineRole, engine_argv

RAW = {"name": "s", "model": {"path": "builtin:tiny-llama"}, "cluster": {"scheduler": "slurm", "gpus_per_node": 4},
       "serve": {"router": True}, "autoscale": {"min": 0, "idle_s": 60}}


def config(**changes):
    return parse_config({**RAW, **changes})


def test_an_idle_replica_sleeps_where_its_engine_can_and_stops_where_it_cannot():
    why = "http://n1:8001 idle for 70 s"
    assert decide_idle(True, None, why).action == "sleep engine"
    slept = decide_idle(True, True, why)
    assert slept.action == "sleep engine" and "allocation kept" in slept.reason and slept.reason.startswith(why)
    refused = decide_idle(True, False, why)
    assert refused.action == "stop" and "cannot sleep" in refused.reason
    off = decide_idle(False, None, why)
    assert off.action == "stop" and "engine.sleep_mode off" in off.reason


def test_a_sleeping_replica_keeps_its_allocation_up_to_release_after_s():
    assert decide_release(3600, 100).action == "hold"
    released = decide_release(3600, 3600)
    assert released.action == "release" and "autoscale.release_after_s 3600" in released.reason


def test_a_model_at_zero_wakes_its_sleeping_replica_before_launching_one():
    assert decide_wake_how("s-m0").action == "wake up" and "POST /wake_up" in decide_wake_how("s-m0").reason
    assert decide_wake_how(None).action == "launch"


def test_sleep_mode_auto_is_on_with_gpus_at_zero_and_off_otherwise():
    assert config().engine_sleeps
    assert not config(cluster={"scheduler": "slurm", "gpus_per_node": 0}).engine_sleeps  # vLLM on CPU
    assert not config(autoscale={"min": 1}).engine_sleeps
    assert not config(engine={"sleep_mode": "off"}).engine_sleeps


@pytest.mark.parametrize("changes, words", [
    ({"cluster": {"scheduler": "slurm", "gpus_per_node": 0}, "engine": {"sleep_mode": "on"}}, "needs GPUs"),
    ({"autoscale": {"min": 1}, "engine": {"sleep_mode": "on"}}, "autoscale.min is 1"),
    ({"engine": {"sleep_mode": "yes"}}, "sleep_mode"),
    ({"autoscale": {"min": 0, "idle_s": 60, "release_after_s": 0}}, "release_after_s"),
])
def test_sleep_settings_that_do_not_fit_are_refused_by_name(changes, words):
    with pytest.raises(ConfigError) as error:
        config(**changes)
    assert words in str(error.value)


def test_the_engines_of_a_sleeping_model_start_in_sleep_mode(tmp_path):
    """What the GPU run checks: --enable-sleep-mode on the command line (engine.args.engine_argv), and
    VLLM_SERVER_DEV_MODE=1 in the engine's environment (engine.replicas, SLEEP_ROUTES_ENV)."""
    from hpcserve.core.config import Layout

    role = EngineRole(0, 8001, 1, 1, "uni")
    member = member_config(config(), "s-m0", 0, Layout(), tmp_path, 0)  # members carry no autoscale
    assert member.engine.sleep_mode == "on" and "--enable-sleep-mode" in engine_argv(member, "/m", role)
    cpu = member_config(config(cluster={"scheduler": "slurm", "gpus_per_node": 0}), "s-m0", 0, Layout(), tmp_path, 0)
    assert "--enable-sleep-mode" not in engine_argv(cpu, "/m", role)


def test_the_data_plane_keeps_vllms_development_routes_from_clients():
    assert engine_only("/sleep?level=1") and engine_only("/wake_up") and engine_only("/collective_rpc")
    assert engine_only("/is_sleeping/") and not engine_only("/v1/completions") and not engine_only("/health")


def test_the_engine_environment_opens_the_sleep_routes_only_in_sleep_mode(tmp_path):
    from hpcserve.core.config import Layout
    from hpcserve.engine.replicas import SLEEP_ROUTES_ENV, ReplicaSet

    def env(cfg) -> dict:
        member = member_config(cfg, "s-m0", 0, Layout(), tmp_path, 0)
        replicas = ReplicaSet(member, Layout(), "/m", tmp_path, "k", 29500, "10.0.0.5:6379")
        return replicas._engine_env(_shape())

    assert env(config())[SLEEP_ROUTES_ENV] == "1"
    assert SLEEP_ROUTES_ENV not in env(config(engine={"sleep_mode": "off"}))


def _shape():
    from hpcserve.core.config import Layout
    from hpcserve.engine.replicas import replica_shapes

    return replica_shapes(Layout(), 4)[0]


def test_the_stand_in_sleeps_as_vllm_does_and_without_sleep_mode_has_no_such_routes():
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from hpcserve.testing.standin import make_app

    async def check() -> None:
        auth = {"Authorization": "Bearer k"}
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        async with TestClient(TestServer(make_app("a", api_key="k", sleep_mode=True))) as client:
            assert (await client.post("/sleep?level=1")).status == 401  # behind the key, as engine.guard puts it
            assert (await (await client.post("/sleep?level=1", headers=auth)).json())["status"] == "sleeping"
            assert (await (await client.get("/is_sleeping", headers=auth)).json()) == {"is_sleeping": True}
            assert (await client.post("/v1/completions", json=body, headers=auth)).status == 503
            assert (await (await client.post("/wake_up", headers=auth)).json())["status"] == "awake"
            assert (await client.post("/v1/completions", json=body, headers=auth)).status == 200
        async with TestClient(TestServer(make_app("b", api_key="k"))) as client:
            assert (await client.post("/sleep?level=1", headers=auth)).status == 404  # as vLLM on CPU

    asyncio.run(check())
