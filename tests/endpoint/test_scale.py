"""The endpoint at many replicas: the pure parts of what makes a round cost the same at 4 and
at 256 replicas, then the real pieces (stand-in farm, prober, router, controller) at a few dozen.

- vLLM's /metrics read from the lines needed gives what the full Prometheus parse gives;
- probe scheduling: busy replicas read five times a second, idle ones once;
- Slurm: one squeue for all jobs, at most one call per interval whatever their number;
- the prober: a killed replica fails at once, a silent one after its timeout, neither holds the rest;
- Router.apply: dozens of membership changes in one call against the real data plane (endpoint/dataplane/);
- the real endpoint over 32 stand-ins: 10 % killed at once under load, 0 failed requests, out of the
  router within 5 s, replaced.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from helpers import free_port

from hpcserve.core.config import parse_config
from hpcserve.core.files import read_json
from hpcserve.core.keys import choose_key
from hpcserve.core.paths import RunPaths
from hpcserve.core.statuses import RunKind
from hpcserve.deployment.runs import LocalRun
from hpcserve.endpoint.control.decisions import reads_due
from hpcserve.endpoint.control.probe import Prober
from hpcserve.endpoint.control.plane_client import Router
from hpcserve.engine.metrics import (
    FINISHED,
    KV_CACHE_USAGE,
    RUNNING,
    WAITING,
    EngineLoad,
    engine_load,
    parse_engine_metrics,
    peak,
    total,
)
from hpcserve.slurm.client import SlurmClient
from hpcserve.slurm.parse import parse_squeue
from hpcserve.slurm.watcher import JobWatcher, jobs_to_ask, refresh_due
from hpcserve.testing.endpoint import FARM_ENV
from hpcserve.testing.harness import ports_to_listen_on, spawn, stop, wait_until
from hpcserve.testing.members import FarmClient

VLLM_METRICS = (Path(__file__).parents[1] / "monitoring" / "data" / "vllm_metrics.txt").read_text()
REPO = Path(__file__).parents[2]


# ------------------------------------------------------------------ /metrics, read fast

def full_parse(text: str) -> EngineLoad:
    metrics = parse_engine_metrics(text)
    return EngineLoad(total(metrics, RUNNING) or 0.0, total(metrics, WAITING) or 0.0, peak(metrics, *KV_CACHE_USAGE),
                      total(metrics, FINISHED))


def test_engine_load_reads_what_the_full_parse_reads():
    def second_engine(text: str, name: str, line: str) -> str:  # a sample added inside its family
        first = next(x for x in text.splitlines() if x.startswith(name + "{"))
        return text.replace(first + "\n", first + "\n" + line + "\n")

    two_engines = second_engine(VLLM_METRICS, RUNNING, 'vllm:num_requests_running{engine="1",model_name="tiny x"} 3.0')
    two_engines = second_engine(two_engines, WAITING, 'vllm:num_requests_waiting{engine="1",model_name="a } b"} 2')
    two_engines = second_engine(two_engines, KV_CACHE_USAGE[0], 'vllm:kv_cache_usage_perc{engine="1",model_name="t"} 0.75')
    for text in (VLLM_METRICS, two_engines, "# nothing\n", VLLM_METRICS.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")):
        assert engine_load(text) == full_parse(text), text[-300:]
    assert engine_load(two_engines) == EngineLoad(3.0, 2.0, 0.75, 1.0)


def test_engine_load_ignores_longer_names_and_comments_and_rejects_a_missing_value():
    text = ("# HELP vllm:num_requests_waiting Number waiting.\n"
            'vllm:num_requests_waiting_by_reason{reason="capacity"} 7.0\n'
            "vllm:num_requests_waiting 1.0\n")
    assert engine_load(text).waiting == 1.0
    with pytest.raises(ValueError):
        engine_load('vllm:num_requests_running{engine="0"} \n')


def test_reading_a_real_page_costs_well_under_a_millisecond():
    started = time.perf_counter()
    for _ in range(100):
        engine_load(VLLM_METRICS)
    assert (time.perf_counter() - started) / 100 < 0.002  # the full parse took 20-75 ms here


# ------------------------------------------------------------------ probe scheduling

def test_busy_replicas_are_read_five_times_a_second_idle_ones_once():
    idle, busy = EngineLoad(0, 0, 0.1, 5), EngineLoad(2, 0, 0.3, 5)
    loads = {"idle": idle, "busy": busy, "paused": idle}
    last = {url: 100.0 for url in ("idle", "busy", "paused")}
    due = lambda now: reads_due(["idle", "busy", "paused", "new"], loads, {"paused"}, last, now, 0.2, 1.0)  # noqa: E731
    assert due(100.2) == ["busy", "paused", "new"]  # new: no load known yet
    assert due(100.5) == ["busy", "paused", "new"]
    assert due(100.95) == ["idle", "busy", "paused", "new"]  # half a rotation early is on time
    assert due(100.05) == ["new"]


# ------------------------------------------------------------------ one squeue for all jobs

# Captured on the sandbox (Slurm 22.05.8): several ids, one unknown -> the known ones, exit 0; only
# unknown ids -> nothing, exit 0; one unknown id alone -> exit 1 "Invalid job id specified".
SQUEUE_MANY = ("23|CANCELLED|Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority "
               "partitions||2026-12-02T04:19:07|2026-12-02T04:19:07|10:00|hpcserve-sb-check\n"
               "20|COMPLETED|None|hsn[1-2]|2026-12-02T04:15:11|2026-12-02T04:17:28|15:00|hpcserve-sb-sif\n"
               "21|RUNNING|None|hsn[1-3]|2026-12-02T04:17:33|2026-12-02T04:28:26|10:00|hpcserve-sb-check-check\n")


class SqueueRunner:
    """A fake runner that answers squeue from a table of jobs and scontrol/sacct with "unknown"."""

    def __init__(self, lines: str):
        self.jobs = {info.job_id: line for info, line in zip(parse_squeue(lines), lines.splitlines())}
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        if argv[0] != "squeue":
            return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Invalid job id specified")
        asked = next(a for a in argv if a.startswith("--jobs=")).removeprefix("--jobs=").split(",")
        lines = [self.jobs[j] for j in asked if j in self.jobs]
        if len(asked) == 1 and not lines:
            return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Invalid job id specified")
        return subprocess.CompletedProcess(argv, 0, "".join(line + "\n" for line in lines), "")


def test_one_squeue_answers_for_many_jobs():
    runner = SqueueRunner(SQUEUE_MANY)
    answer = SlurmClient(runner=runner).jobs(["23", "20", "21", "999999", "20"])
    assert sorted(answer) == ["20", "21", "23"] and answer["21"].state == "RUNNING"
    assert len(runner.calls) == 1 and "--jobs=20,21,23,999999" in runner.calls[0]
    assert SlurmClient(runner=runner).jobs(["999999"]) == {}
    assert SlurmClient(runner=runner).jobs([]) == {}


def test_jobs_to_ask_and_when():
    known = {info.job_id: info for info in parse_squeue(SQUEUE_MANY)}
    known["9"] = None  # no Slurm command knows it
    assert jobs_to_ask({"20", "21", "23", "9", "30"}, known) == ["21", "30"]  # finished or unknown: asked no more
    assert refresh_due(None, 0, 5, {"21"}, known)
    assert not refresh_due(100, 104, 5, {"21"}, known) and refresh_due(100, 105, 5, {"21"}, known)
    assert refresh_due(100, 101, 5, {"21", "30"}, known)  # a new job: asked about within a second
    assert not refresh_due(100, 200, 5, {"20"}, known)  # only finished jobs: nothing to ask


def test_the_watcher_asks_slurm_once_per_interval_whatever_the_number_of_jobs():
    lines = "".join(f"{100 + i}|RUNNING|None|hsn{i % 3 + 1}|2026-12-02T04:00:00|2026-12-02T05:00:00|1:00:00|m{i}\n"
                    for i in range(256))
    runner = SqueueRunner(lines)
    now = [1000.0]
    watcher = JobWatcher(SlurmClient(runner=runner), interval_s=5.0, clock=lambda: now[0])
    for i in range(256):  # as Runs.launch does at each submission
        watcher.watch(str(100 + i))
    for second in range(30):  # every job asked about every second, as a controller's round does
        now[0] = 1000.0 + second
        assert all(watcher.info(str(100 + i)).state == "RUNNING" for i in range(256))
    assert len(runner.calls) == 6  # 30 s / 5 s, one call for all 256
    runner.jobs.pop("100")  # squeue forgot it: asked alone (scontrol, sacct), then never again
    now[0] += 5
    assert watcher.info("100") is None and watcher.info("101").state == "RUNNING"
    asked_alone = [c for c in runner.calls if c[0] != "squeue"]
    now[0] += 5
    watcher.info("101")
    assert "100" not in next(a for a in runner.calls[-1] if a.startswith("--jobs=")).split("=")[1].split(",")
    assert len([c for c in runner.calls if c[0] != "squeue"]) == len(asked_alone) >= 1


# ------------------------------------------------------------------ the real pieces at a few dozen

@pytest.fixture()
def farm(tmp_path):
    """A farm of 40 stand-ins (one process) and its admin API."""
    *ports, admin = ports_to_listen_on(41)
    proc = spawn([sys.executable, "-m", "hpcserve.testing.standin", "--ports", ",".join(map(str, ports)),
                  "--admin-port", str(admin)], tmp_path / "farm.log")
    client = FarmClient(f"http://127.0.0.1:{admin}")
    try:
        wait_until(lambda: len(client.describe()["standins"]) == 40, 60, "the farm")
        yield client, [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        stop(proc)


def test_prober_a_killed_replica_fails_at_once_a_silent_one_after_its_timeout(farm):
    client, urls = farm
    client.act("kill", [int(urls[0].rsplit(":", 1)[1])])
    client.act("freeze", [int(urls[1].rsplit(":", 1)[1])])
    prober = Prober(None)
    try:
        started = time.monotonic()
        probed = prober.probe(urls, timeout_s=1.0)
        took = time.monotonic() - started
    finally:
        prober.close()
    assert not probed[urls[0]].ok and not probed[urls[1]].ok
    assert probed[urls[1]].late and not probed[urls[0]].late  # hung (connected, no answer), dead (refused)
    assert all(probed[u].ok and probed[u].load is not None for u in urls[2:])
    assert took < 3.0  # about the one timeout, not one per replica


def test_router_apply_changes_dozens_of_backends_in_one_call(farm, tmp_path):
    _, urls = farm
    router = Router("127.0.0.1", free_port(), None, tmp_path / "router.log")
    try:
        router.start(urls[:1])
        assert router.apply(add=urls[1:30] + ["http://127.0.0.1:1"]) == {"http://127.0.0.1:1"}
        assert {b.url for b in router.backends()} == set(urls[:30])
        assert router.apply(remove=urls[10:30]) == set()
        assert {b.url for b in router.backends()} == set(urls[:10])
    finally:
        router.stop()
        router.close()


def test_the_endpoint_over_32_standins_loses_10_percent_at_once_without_a_failed_request(farm, tmp_path,
                                                                                           monkeypatch):
    client, urls = farm
    client.act("stop", [int(u.rsplit(":", 1)[1]) for u in urls])  # members start theirs
    monkeypatch.setenv("HPCSERVE_SCALE_KEY", "scale-test-key")
    raw = {"name": "scale32", "model": {"path": "builtin:tiny-llama", "served_name": "stub"},
           "cluster": {"scheduler": "local", "cpus_per_node": 32}, "parallelism": {"replicas": 32},
           "serve": {"port": free_port(), "api_key_env": "HPCSERVE_SCALE_KEY"}}
    (tmp_path / "endpoint.yaml").write_text(yaml.safe_dump(raw))
    record = LocalRun.start(parse_config(raw), tmp_path, "hpcserve.testing.endpoint", RunKind.ENDPOINT,
                            choose_key("HPCSERVE_SCALE_KEY", False), {FARM_ENV: client.admin_url}).record
    state = lambda: read_json(RunPaths(Path(record.run_dir)).state, {}) or {}  # noqa: E731
    try:
        wait_until(lambda: state().get("status") in ("ready", "failed"), 120, "the endpoint")
        assert state()["status"] == "ready", state().get("error")
        router = state()["endpoint"]["url"]
        admin = Router("127.0.0.1", 0, None, tmp_path / "unused.log", admin_socket=RunPaths(Path(record.run_dir)).router_admin)
        workers = lambda: {b.url for b in admin.backends()}  # noqa: E731 - the data plane's list, on its admin socket
        serving = sorted(workers())
        assert len(serving) == 32
        out = tmp_path / "load.json"
        load = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "scale_load.py"), "--url", router,
                                 "--rate", "100", "--duration-s", "12", "--key", "scale-test-key", "--out", str(out)])
        time.sleep(3)
        victims = serving[::8][:3]
        killed = time.monotonic()
        client.act("kill", [int(u.rsplit(":", 1)[1]) for u in victims])
        wait_until(lambda: not set(victims) & workers(), 10, "the killed replicas out of the router", poll_s=0.05)
        out_after = time.monotonic() - killed
        load.wait(timeout=60)
        result = json.loads(out.read_text())
        assert result["failed"] == 0, result["errors"]
        assert out_after <= 5.0
        wait_until(lambda: len(workers()) == 32, 30, "the replacements in the router")
        control = state()["control"]
        assert control["round_ms_p99"] < 1000, control  # a loose bound on a shared machine (docs: 250 ms)
    finally:
        LocalRun(record).stop(timeout_s=60)


def test_a_backend_the_pool_did_not_join_itself_leaves_after_failed_probes_too(tmp_path):
    # An adopting controller takes over replicas that joined under its lost predecessor: they serve without
    # a join here, and their probes must count (a node lost after adoption left only when Slurm said so).
    from hpcserve.endpoint.control.pool import Pool
    from hpcserve.endpoint.control.probe import ProbeKind, Probed, Result

    router = Router("127.0.0.1", 0, None, tmp_path / "unused.log", admin_socket=tmp_path / "a.sock")
    pool = Pool(router, None, "tiny", 1.0, lambda: ["http://adopted:1"])
    try:
        failed = Result("http://adopted:1", ProbeKind.PROBE, Probed(False, "ConnectTimeout"), time.monotonic())
        pool.absorb([failed, failed])
        assert pool.leaving() == ["http://adopted:1"]
        pool.absorb([Result("http://gone:2", ProbeKind.PROBE, Probed(False), time.monotonic())])
        assert "http://gone:2" not in pool.probes  # a backend that left stays forgotten
    finally:
        pool.prober.close()
        router.close()


def test_a_request_the_data_plane_has_sent_keeps_its_replica_busy_before_the_engine_counts_it(farm, tmp_path):
    # A drain stops a member once nothing runs on it. The engine's /metrics shows a request only once its
    # server has taken it: stopping on that alone cut a request sent just before the drain (handover test).
    client, urls = farm
    url = urls[0]
    client.act("freeze", [int(url.rsplit(":", 1)[1])])  # takes the request, counts nothing, /metrics silent
    router = Router("127.0.0.1", free_port(), None, tmp_path / "router.log")
    try:
        router.start([url])
        def send() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the frozen engine never answers
                httpx.post(f"{router.url}/v1/completions", json={"model": "stub", "prompt": "x"}, timeout=3)
        sender = threading.Thread(target=send)
        sender.start()
        wait_until(lambda: router.in_flight(url) == 1, 10, "the request in the data plane")
        assert router.engine_load(url, timeout_s=0.5) is None  # the engine says nothing about it
        assert router.busy(url)
        sender.join(15)
    finally:
        router.stop()
        router.close()
