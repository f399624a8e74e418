"""The controller's round (Controller.tick) in this process, over its seams: members started by a launcher of
the test's (deployment.runs.Launcher) whose replicas are stand-in engines (testing.standin) on an event loop
of their own, reached over HTTP by the controller's probes and joins as vLLM is; the data plane as the
controller drives it (plane_client.Router's calls), kept in memory. What the same rounds do over real jobs
and a real data plane: tests/cluster. Each test takes well under a second."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from hpcserve.core.config import AutoscaleSpec, DeploymentConfig, Layout
from hpcserve.core.keys import ApiKey
from hpcserve.core.registry import Record
from hpcserve.core.runstate import RunStateWriter
from hpcserve.core.statuses import MemberRole, MemberStatus, RunKind, RunStatus
from hpcserve.deployment.runs import WithoutSlurmJob
from hpcserve.endpoint.control.controller import Controller, percentiles_ms
from hpcserve.endpoint.control.members import Member
from hpcserve.endpoint.control.plane_client import RouterError
from hpcserve.testing.standin import STATS, MetricsPage, make_app

KEY = "controller-key"
WAIT_S = 5.0  # a bound on waits for the controller's threads (joins, probes); they take milliseconds


class Engines:
    """Stand-in engines served on an event loop in a thread of its own: the controller reaches them from its
    threads (joins, the prober's loop) over HTTP, as it reaches vLLM."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="engines", daemon=True)
        self.thread.start()
        self.servers: list[TestServer] = []

    def start(self, name: str) -> tuple[str, web.Application]:
        app = make_app(name, api_key=KEY, metrics=MetricsPage.load(small=True))
        server = TestServer(app)
        asyncio.run_coroutine_threadsafe(server.start_server(), self.loop).result(WAIT_S)
        self.servers.append(server)
        return str(server.make_url("")).rstrip("/"), app

    def close(self) -> None:
        for server in self.servers:
            asyncio.run_coroutine_threadsafe(server.close(), self.loop).result(WAIT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)
        self.loop.close()


@dataclass
class StandinRun(WithoutSlurmJob):
    """A member's run (deployment.runs.Run): gone once the test ends it; stopped when the controller says."""

    launcher: StandinMembers
    name: str

    def gone(self) -> str | None:
        return self.launcher.ended.get(self.name)

    def stop(self, timeout_s: float = 90.0, grace_s: float = 0.0) -> list[int]:
        self.launcher.stopped.append(self.name)
        return []


@dataclass
class StandinMembers:
    """A Launcher whose members are ready at once: a stand-in engine each, and the run folder's state.json
    as the driver writes it once its replica answered a completion."""

    engines: Engines
    apps: dict[str, web.Application] = field(default_factory=dict)  # member -> its engine
    ended: dict[str, str] = field(default_factory=dict)  # member -> why its run is gone
    stopped: list[str] = field(default_factory=list)

    def launch(self, cfg: DeploymentConfig, results: Path, key: ApiKey, extra_env: dict[str, str]) -> Record:
        run_dir = results / "logs" / cfg.name
        run_dir.mkdir(parents=True)
        url, self.apps[cfg.name] = self.engines.start(cfg.name)
        RunStateWriter(run_dir).update(status=RunStatus.READY, replicas=[
            {"index": 0, "url": url, "model": cfg.model.name, "healthy": True, "nodes": ["here"]}])
        return Record(name=cfg.name, scheduler="local", run_dir=str(run_dir), driver_pid=os.getpid(),
                      kind=RunKind.DRIVER)

    def run_of(self, record: Record) -> StandinRun:
        return StandinRun(self, record.name)

    def slurm_queries(self) -> int | None:
        return None


@dataclass
class PlaneInMemory:
    """The data plane as the controller drives it (plane_client.Router's calls): the desired backends.
    broken: what every call raises (an admin socket that refuses), None while it answers."""

    url: str = "http://127.0.0.1:9"
    pid: int | None = None
    log_path: Path = Path("router.log")
    desired: dict[str, int] = field(default_factory=dict)  # url -> capacity, in join order
    saturated: set[str] = field(default_factory=set)
    broken: Exception | None = None
    waiting: int = 0  # requests its admission keeps waiting (GET /backends)

    def answer(self) -> None:
        if self.broken is not None:
            raise self.broken

    def alive(self) -> bool:
        self.answer()
        return True

    def start(self, backends: Iterable[str] = ()) -> None:
        self.answer()

    def stop(self) -> None:
        pass

    def apply(self, add: Iterable[str] = (), remove: Iterable[str] = (), capacities: dict[str, int] | None = None,
              kv_tokens: dict[str, int | None] | None = None) -> set[str]:
        self.answer()
        for url in remove:
            self.desired.pop(url, None)
        self.desired.update({url: (capacities or {}).get(url, 1) for url in add})
        return set()

    def hand_over(self, urls: Iterable[str]) -> list[str]:
        self.answer()
        return list(urls)

    def busy(self, url: str) -> bool:
        return False

    def capacities(self) -> dict[str, int]:
        return dict(self.desired)

    def set_saturated(self, urls: Iterable[str]) -> None:
        self.answer()
        self.saturated = set(urls)

    def migrations(self, after: float) -> list[dict]:
        self.answer()
        return []

    def backends_json(self) -> dict:
        self.answer()
        return {"waiting": self.waiting, "backends": [{"url": url, "capacity": capacity}
                                                      for url, capacity in self.desired.items()]}


@dataclass
class Endpoint:
    ctl: Controller
    members: StandinMembers
    plane: PlaneInMemory

    def actions(self) -> list[tuple[str, str]]:
        return [(d.action, d.reason) for d in self.ctl.decisions]

    def start(self, count: int = 1) -> list[Member]:
        """Members launched, their replicas joined (the round's join step, waited for), and the endpoint
        ready: where process.serve hands over to the rounds. No round has run yet, so the next one asks
        about the members' runs (check_jobs asks at most every JOB_CHECK_EVERY_S)."""
        members = [self.ctl.launch(MemberRole.INITIAL, Layout()) for _ in range(count)]
        self.ctl.check_members()
        for member in members:
            self.ctl.joining[member.name].result(WAIT_S)
        assert all(m.status is MemberStatus.SERVING for m in members), self.actions()
        self.ctl.ready = True
        return members

    def tick_until(self, done: Callable[[], bool]) -> None:
        """Rounds, a few ms apart, until done() (the controller's probes run in its prober's thread)."""
        deadline = time.monotonic() + WAIT_S
        self.ctl.tick()
        while not done():
            assert time.monotonic() < deadline, self.actions()
            time.sleep(0.01)
            self.ctl.tick()


def config(**changes) -> DeploymentConfig:
    return DeploymentConfig(name="ctl", model={"path": "builtin:tiny-llama", "served_name": "stub"}, **changes)


@pytest.fixture
def endpoint(tmp_path) -> Iterator[Callable[..., Endpoint]]:
    engines, made = Engines(), []

    def make(cfg: DeploymentConfig | None = None) -> Endpoint:
        members, plane = StandinMembers(engines), PlaneInMemory()
        ctl = Controller(cfg or config(), tmp_path / "endpoint", plane, KEY, members)  # type: ignore[arg-type]
        made.append(ctl)
        return Endpoint(ctl, members, plane)

    try:
        yield make
    finally:
        for ctl in made:
            ctl.close()
        engines.close()


def test_a_member_whose_run_ended_leaves_the_pool_and_is_replaced_in_the_same_round(endpoint):
    end = endpoint()
    (lost,) = end.start()
    (url,) = lost.backends
    assert list(end.plane.desired) == [url]
    end.members.ended[lost.name] = "the driver process exited (code 1)"
    end.ctl.tick()
    assert ("leave", f"{url}: the driver process exited (code 1)") in end.actions()
    assert url not in end.plane.desired
    successor = end.ctl.members[-1]
    assert (successor.role, successor.replaces, lost.successor) == (MemberRole.REPLACEMENT, lost.name, successor.name)
    assert ("launch replacement", f"{successor.name} (local driver), replacing {lost.name}") in end.actions()
    end.tick_until(lambda: successor.status is MemberStatus.SERVING)  # its replica joins in the next rounds
    assert list(end.plane.desired) == successor.backends
    assert lost.name in end.members.stopped and lost.status.lost
    assert not [a for a in end.actions() if a[0] == "error"]


def test_a_queue_above_target_on_the_engines_launches_one_more_replica(endpoint):
    spec = AutoscaleSpec(min=1, max=2, target_queue=2, scale_up_after_s=0.05)
    end = endpoint(config(autoscale=spec))
    (member,) = end.start()
    end.members.apps[member.name][STATS]["waiting"] = 5  # its engine's /metrics: five requests queued
    end.tick_until(lambda: len(end.ctl.members) > 1)
    added = end.ctl.members[-1]
    assert (added.role, added.status) == (MemberRole.SCALE_UP, MemberStatus.LAUNCHING)
    scale_up = [reason for action, reason in end.actions() if action == "scale up"]
    assert len(scale_up) == 1 and "5.0 requests waiting per replica" in scale_up[0], end.actions()
    assert end.ctl.autoscaler.last is not None and end.ctl.autoscaler.last["action"] == "up"


def test_a_queue_in_the_data_plane_launches_one_more_replica_while_the_engines_queue_nothing(endpoint):
    spec = AutoscaleSpec(min=1, max=2, target_queue=2, scale_up_after_s=0.05)
    end = endpoint(config(autoscale=spec))
    end.start()
    end.plane.waiting = 7  # fair share holds a user's excess in the data plane; the engine's queue is empty
    end.tick_until(lambda: len(end.ctl.members) > 1)
    scale_up = [reason for action, reason in end.actions() if action == "scale up"]
    assert len(scale_up) == 1 and "7.0 requests waiting per replica" in scale_up[0], end.actions()


def test_a_step_that_fails_is_an_error_decision_and_the_rest_of_the_round_runs(endpoint, tmp_path):
    end = endpoint()
    (lost,) = end.start()
    end.plane.broken = RouterError("the admin socket refused the connection")
    end.members.ended[lost.name] = "its job ended (TIMEOUT)"
    end.ctl.tick()
    errors = [reason for action, reason in end.actions() if action == "error"]
    assert errors[0] == "keep_router_up: RouterError: the admin socket refused the connection", errors
    # check_jobs comes after keep_router_up: the ended member was still taken out of the pool (the router
    # refused that change too, an error of its own) and is stopped; self-healing launched its replacement.
    assert errors[1].startswith("check_jobs: RouterError"), errors
    assert lost.name in end.members.stopped and lost.status is not MemberStatus.SERVING
    assert end.ctl.members[-1].replaces == lost.name
    saved = json.loads((tmp_path / "endpoint" / "state.json").read_text())  # the round's end: state saved
    assert [d["action"] for d in saved["decisions"]].count("error") == len(errors)


def test_the_round_times_in_state_json_are_percentiles_as_the_benchmarks_compute_them():
    figures = percentiles_ms("round", [0.004, 0.001, 0.003, 0.002])
    # Interpolated between order statistics (benchmark.stats.percentile): p50 of four is their middle two's mean
    assert figures == {"rounds_kept": 4, "round_ms_p50": 2.5, "round_ms_p99": 3.97, "round_ms_max": 4.0}
    assert percentiles_ms("step", [])["step_ms_p99"] is None
