"""Every table the CLI prints reads at 80 columns: no cell cut ("…"), no table line wider than 80, and
what is long (notes, paths, URLs) printed whole below the table."""

from __future__ import annotations

import io
import json
import time
import types
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from hpcserve import api
from hpcserve.benchmark.compare import columns_by_load, comparison_table
from hpcserve.benchmark.loadgen import LoadShape, RequestOutput
from hpcserve.benchmark.report import summary_table
from hpcserve.benchmark.summary import BenchResult, BenchRun, summarize
from hpcserve.cli.status import status_view
from hpcserve.cli.sandbox import print_status
from hpcserve.cli.watch import render
from hpcserve.core.config import load_config
from hpcserve.core.statuses import RunStatus
from hpcserve.doctor.findings import Finding, Severity
from hpcserve.doctor.report import findings_table
from hpcserve.monitoring.metrics import Gatherer
from hpcserve.planning.planner import plan_for_config
from hpcserve.planning.report import render_plan_table
from hpcserve.raycluster.health import HealthReport, NodeReport, render_table
from hpcserve.sandbox.cluster import HostStatus, SandboxStatus

REPO = Path(__file__).resolve().parents[2]
LONG_PATH = "/scratch/project_4501234/a-long-user-name/hpcserve-results/logs/sb-reps-endpoint-20261202-101500"
LONG_URL = "http://gpu-node-0042.cluster.example-university.edu:8301"


def rendered(renderable) -> list[str]:
    console = Console(width=80, file=io.StringIO(), record=True, soft_wrap=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def assert_narrow(lines: list[str], *whole: str) -> None:
    text = "\n".join(lines)
    assert "…" not in text, text
    for long_text in whole:
        assert long_text in text, f"{long_text!r} is not printed whole:\n{text}"
    wide = [line for line in lines if len(line) > 80 and not any(w in line for w in whole)]
    assert wide == [], "\n".join(wide)


@pytest.mark.parametrize("concurrency", [None, 64])
def test_plan_of_the_70b_example(concurrency):
    cfg = load_config(REPO / "examples" / "slurm-llama-70b.yaml")
    if concurrency:
        cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"expected_concurrency": concurrency})})
    plan = plan_for_config(cfg, None)
    rejected = "; ".join(plan.rejected[0].problems)
    assert_narrow(rendered(render_plan_table(plan)), rejected)


def test_status_keeps_urls_and_paths_whole():
    row = api.DeploymentStatus(
        name="sb-reps", scheduler="slurm", status=RunStatus.READY, stage="ready", runner="endpoint pid 4242",
        run_dir=LONG_PATH, replicas=[{"index": i, "url": f"{LONG_URL}{i}", "healthy": i == 0, "compile_cache": "hit"}
                                     for i in range(2)],
        error=None, endpoint="http://login-node-07.cluster.example-university.edu:8300",
        members=[{"name": "sb-reps-m0", "role": "initial", "status": "serving", "group": 0, "runner": "job 123456",
                  "backends": [], "ready_s": 81.0, "note": "", "run_dir": LONG_PATH, "error": None}],
        decisions=[{"time": 0.0, "action": "join", "reason": f"sb-reps-m0: {LONG_URL}0 in the pool after 81 s"}])
    lines = rendered(status_view([row]))
    assert_narrow(lines, LONG_PATH, f"{LONG_URL}0 healthy, compile cache hit", f"{LONG_URL}1", row.endpoint,
                  row.decisions[0]["reason"])
    assert "\n".join(lines).count("healthy") == 1 and "DOWN" in "\n".join(lines)
    assert "waiting for room" not in "\n".join(lines)
    row.admission_waiting = 12
    assert "12 request(s) waiting for room in the KV caches" in " ".join(rendered(status_view([row])))


def test_health_check():
    note = "CUDA_VISIBLE_DEVICES lists 4 GPUs but NVML sees 2: Slurm's GRES and the node disagree; ask the admins"
    report = HealthReport(nodes=[NodeReport("gpu-node-0042", "10.140.12.42", "n" * 56, 64, 503.7, ["0", "1", "2", "3"],
                                            "0,1,2,3", 2, [80000] * 2, [note])],
                          transfers=[], collective=None, placement_group_s=0.1, task_rtt_ms=1.0, failures=[])
    assert_narrow(rendered(render_table(report)), note)


def test_doctor_findings():
    findings = [Finding(Severity.BLOCKER, "partition", "partition 'gpu-h100-long' does not exist on this cluster "
                        "(sinfo lists: cpu, gpu-a100, gpu-h100, debug)", "set cluster.partition to one of them"),
                Finding(Severity.OK, "controller", "slurmctld answers (Slurm 22.05.8)")]
    assert_narrow(rendered(findings_table(findings, "hpcserve doctor: x")), findings[0].what, findings[0].fix)


def bench_result(target: str, loads=(1, 8, 32, 64)) -> BenchResult:
    runs = []
    for concurrency in loads:
        outputs = [RequestOutput(ok=True, ttft_s=0.05 * (i + 1), e2e_s=12.5 + 0.01 * i, output_tokens=320,
                                 prompt_tokens=64, itl_s=[0.01] * 319, start_s=0.1 * i) for i in range(20)]
        runs.append(BenchRun(load=LoadShape(concurrency).as_dict(), summary=summarize(outputs, duration_s=1.0),
                             requests=[]))
    return BenchResult(target=target, date="2026-12-02T10:00:00+00:00", command=["x"], config={}, endpoints=[target],
                       runs=runs, gpus=8)


def test_bench_summary_and_comparison():
    result = bench_result(LONG_URL)
    assert_narrow(rendered(summary_table(result)), LONG_URL)
    named = [(f"{LONG_PATH}/bench-{i}.json", result) for i in range(3)]
    for label, columns in columns_by_load(named).items():
        assert_narrow(rendered(comparison_table(label, columns)), *(name for name, _ in named))


def test_sandbox_status(capsys):
    hosts = [HostStatus(f"hsn{i}", f"198.18.0.{10 + i}", 1000 + i, "idle") for i in range(1, 4)]
    status = SandboxStatus(LONG_PATH, f"{LONG_PATH}/etc/slurm.conf", True, 99, HostStatus("hsctl", "198.18.0.10", 9, "-"),
                           hosts)
    from hpcserve.cli import sandbox

    sandbox.console = Console(width=80, file=io.StringIO(), record=True, soft_wrap=True, color_system=None)
    print_status(status)
    assert_narrow(sandbox.console.export_text().splitlines(), LONG_PATH, f"{LONG_PATH}/etc/slurm.conf")


def test_live_view(tmp_path):
    (tmp_path / "monitor").mkdir()
    (tmp_path / "monitor" / "gpu-node-0042.jsonl").write_text(json.dumps(
        {"time": time.time(), "host": "gpu-node-0042", "cpu_pct": 99.5, "ram_used_mb": 512000, "engine_rss_mb": 96000,
         "engine_cpu_pct": 100.0, "gpus": [{"index": i, "util_pct": 98, "mem_used_mb": 78000, "mem_total_mb": 81559}
                                           for i in range(4)]}) + "\n")
    replicas = [{"index": i, "url": f"{LONG_URL}{i}", "model": "m", "nodes": ["gpu-node-0042"], "healthy": True}
                for i in range(2)]
    status = types.SimpleNamespace(name="sb-reps", scheduler="slurm", status="ready", stage="ready",
                                   runner="job 123456: RUNNING on gpu-node-0042", run_dir=str(tmp_path),
                                   replicas=replicas, error=None, job_id="123456")
    text = (Path(__file__).parents[1] / "monitoring" / "data" / "vllm_metrics.txt").read_text()
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, text=text)))
    snapshot = Gatherer("sb-reps", status_fn=lambda name: status, key_fn=lambda name: None, client=client).snapshot()
    assert_narrow(rendered(render(snapshot)), f"{LONG_URL}0", f"{LONG_URL}1")
