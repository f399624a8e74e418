"""An endpoint in local mode for the sleep and swap tests: the real endpoint process whose members are local
stand-in engines (hpcserve.testing.member), at zero (autoscale.min 0) or as the test configures it, and what
the tests read of it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from helpers import free_port

from hpcserve.core.config import parse_config
from hpcserve.core.keys import choose_key
from hpcserve.core.registry import Record as RunRecord
from hpcserve.core.registry import forget, save_record
from hpcserve.core.runstate import RunState
from hpcserve.core.statuses import RunKind
from hpcserve.deployment.runs import LocalRun
from hpcserve.testing.endpoint import MEMBER_ENV
from hpcserve.testing.harness import wait_until

BODY = {"model": "stub", "prompt": "hi", "max_tokens": 4}
HTTP = httpx.Client(timeout=60, trust_env=False)


@contextmanager
def endpoint_at_zero(directory: Path, name: str, key_env: str, key: str, autoscale: dict | None = None,
                     engine: dict | None = None) -> Iterator[tuple[RunRecord, str]]:
    """(its run record, its URL) once it is ready; stopped (and forgotten) at the end."""
    with local_endpoint(directory, name, key_env, key, engine=engine or {},
                        autoscale={"min": 0, "max": 1, "idle_s": 2, "scale_down_after_s": 2, "wake_wait_s": 60,
                                   **(autoscale or {})}) as running:
        yield running


@contextmanager
def local_endpoint(directory: Path, name: str, key_env: str, key: str,
                   **sections: dict) -> Iterator[tuple[RunRecord, str]]:
    """An endpoint of one stand-in member, its config's sections (engine, cluster, ...) replaced by these."""
    mp = pytest.MonkeyPatch()
    mp.setenv(key_env, key)
    mp.setenv("HPCSERVE_HOME", str(directory / "home"))
    raw = {"name": name, "model": {"path": "builtin:tiny-llama", "served_name": "stub"},
           "cluster": {"scheduler": "local"}, "parallelism": {"replicas": 1},
           "serve": {"port": free_port(), "api_key_env": key_env, "router_workers": 1},
           "results_dir": str(directory), **sections}
    record = LocalRun.start(parse_config(raw), directory, "hpcserve.testing.endpoint", RunKind.ENDPOINT,
                            choose_key(key_env, False), {MEMBER_ENV: "1"}).record
    save_record(record)  # `status NAME` finds it, as `up` registers it
    try:
        wait_until(lambda: state(record).status in ("ready", "failed"), 120, "the endpoint")
        assert state(record).status == "ready"
        yield record, state(record).endpoint_url
    finally:
        LocalRun(record).stop(timeout_s=60)
        forget(name)
        mp.undo()


def state(record: RunRecord) -> RunState:
    return RunState.read(record.run_dir)


def decisions(record: RunRecord, action: str, since: float = 0.0) -> list:
    return [d for d in state(record).decisions if d.action == action and d.time >= since]


def model_state(url: str, headers: dict[str, str]) -> str:
    return HTTP.get(f"{url}/v1/models/stub", headers=headers).json()["state"]
