"""Single-node validation (seed stage 2): can this model serve on one node, how fast, in how much memory?

Runs the deployment on one node (its layout cut down to one replica that fits a node), samples memory
while the model loads and while it serves (NVML on GPUs; the engine processes' RSS and CPU otherwise),
runs a short load at concurrency 1 and N, stops everything, and writes validation.json and
validation.md into RESULTS/logs/<name>/.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcserve import api
from hpcserve.benchmark.bench import BenchOptions, run_benchmark
from hpcserve.benchmark.loadgen import LoadShape
from hpcserve.benchmark.workload import LengthRange
from hpcserve.core.config import DeploymentConfig, Layout, load_config
from hpcserve.core.config_checks import slots_per_node
from hpcserve.core.runstate import read_timeline
from hpcserve.core.timeline import stage_durations
from hpcserve.monitoring.sampler import read_samples
from hpcserve.planning.model_source import model_config_for, resolve_model_path


@dataclass
class LoadFigures:
    concurrency: int
    requests: int
    failed: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    e2e_p50_ms: float


@dataclass
class MemoryFigures:
    samples_during_load: int
    samples_during_serving: int
    engine_rss_peak_mb: float
    engine_cpu_mean_pct: float
    gpu_mem_peak_mb: float | None
    gpu_util_mean_pct: float | None


@dataclass
class Validation:
    name: str
    run_dir: str
    ok: bool
    up_to_ready_s: float
    model_load_s: float
    loads: list[LoadFigures]
    memory: MemoryFigures
    error: str | None = None


def single_node(cfg: DeploymentConfig) -> DeploymentConfig:
    """The same deployment cut to one node and one replica (pipeline stages folded into tensor)."""
    layout = cfg.parallelism if isinstance(cfg.parallelism, Layout) else Layout()
    tensor = min(layout.tensor * layout.pipeline, slots_per_node(cfg.cluster))
    cluster = cfg.cluster.model_copy(update={"nodes": 1})
    serve = cfg.serve.model_copy(update={"router": False})  # the engine itself is measured, not a router
    return cfg.model_copy(update={"name": f"{cfg.name}-validate"[:40], "cluster": cluster, "serve": serve,
                                  "autoscale": None, "parallelism": Layout(tensor=tensor, pipeline=1, replicas=1)})


def memory_figures(samples: dict[str, list[dict]], engine_started: float, engine_ready: float) -> MemoryFigures:
    """Split samples into model load and serving; peaks and means. Pure."""
    flat = [s for host in samples.values() for s in host]
    loading = [s for s in flat if engine_started <= s["time"] < engine_ready]
    serving = [s for s in flat if s["time"] >= engine_ready]
    engine = loading + serving
    gpu_mem = [sum(g["mem_used_mb"] for g in s["gpus"]) for s in engine if s.get("gpus")]
    gpu_util = [sum(g["util_pct"] for g in s["gpus"]) / len(s["gpus"]) for s in serving if s.get("gpus")]
    cpu = [s["engine_cpu_pct"] for s in serving] or [0.0]
    return MemoryFigures(len(loading), len(serving), max((s["engine_rss_mb"] for s in engine), default=0.0),
                         round(sum(cpu) / len(cpu), 1), max(gpu_mem) if gpu_mem else None,
                         round(sum(gpu_util) / len(gpu_util), 1) if gpu_util else None)


def load_figures(run) -> LoadFigures:
    s = run.summary
    return LoadFigures(run.load.get("concurrency") or 0, s.completed + s.failed, s.failed,
                       round(s.request_throughput, 3), round(s.output_throughput, 2), round(s.ttft_ms.p50, 2),
                       round(s.ttft_ms.p99, 2), round(s.tpot_ms.p50, 2), round(s.e2e_ms.p50, 2))


def validate(config_path: str | Path, concurrency: int = 8, num_prompts: int = 32, input_len: int = 64,
             output_len: int = 32, on_event: Callable | None = None) -> Validation:
    cfg = single_node(load_config(config_path))
    result = api.up(cfg, on_event=on_event)
    run_dir = result.run_dir
    try:
        if result.status is not api.RunStatus.READY:
            return Validation(cfg.name, str(run_dir), False, result.seconds, 0.0, [], memory_figures({}, 0, 0),
                              error=json.dumps(result.error))
        endpoints = api.endpoints(cfg.name)
        options = BenchOptions(loads=(LoadShape(concurrency=1), LoadShape(concurrency=concurrency)),
                               num_prompts=num_prompts, input_len=LengthRange(input_len, input_len),
                               output_len=output_len, vocab_size=_vocab_size(cfg), timeout_s=600)
        bench = run_benchmark(endpoints, options, target=cfg.name, command=["hpcserve", "validate", str(config_path)])
        time.sleep(1.5)  # one more monitor sample after the load (the sampler writes every second)
    finally:
        api.down(cfg.name)
    timeline = read_timeline(run_dir)
    engine = [e["time"] for e in timeline if e["stage"] == "engine"]
    durations = stage_durations(timeline)
    memory = memory_figures(read_samples(run_dir), engine[0], engine[1]) if len(engine) >= 2 else memory_figures({}, 0, 0)
    loads = [load_figures(run) for run in bench.runs]
    ok = all(f.failed == 0 and f.output_tokens_per_s > 0 for f in loads)
    return Validation(cfg.name, str(run_dir), ok, round(result.seconds, 1), round(durations.get("engine", 0.0), 1),
                      loads, memory)


def _vocab_size(cfg: DeploymentConfig) -> int:
    model_config = model_config_for(cfg, resolve_model_path(cfg)) or {}
    return int(model_config.get("vocab_size", 32000))


def write_report(validation: Validation, results_dir: Path, base_name: str) -> Path:
    folder = Path(results_dir) / "logs" / base_name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "validation.json").write_text(json.dumps(asdict(validation), indent=2))
    (folder / "validation.md").write_text("\n".join(report_lines(validation)) + "\n")
    return folder


def report_lines(v: Validation) -> list[str]:
    m = v.memory
    lines = [f"# Validation of {v.name}: {'OK' if v.ok else 'FAILED'}", "",
             f"- up to ready: {v.up_to_ready_s} s (model load and first completion: {v.model_load_s} s)",
             f"- engine memory peak (RSS): {m.engine_rss_peak_mb:.0f} MB; engine CPU while serving: {m.engine_cpu_mean_pct}%",
             f"- GPU memory peak: {m.gpu_mem_peak_mb} MB; GPU utilisation while serving: {m.gpu_util_mean_pct}%"
             if m.gpu_mem_peak_mb is not None else "- GPUs: none sampled (CPU engine or no NVML)",
             f"- monitor samples: {m.samples_during_load} during load, {m.samples_during_serving} while serving",
             f"- run folder: {v.run_dir}", "",
             "| concurrency | requests | failed | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | E2E p50 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {f.concurrency} | {f.requests} | {f.failed} | {f.requests_per_s} | {f.output_tokens_per_s} | "
              f"{f.ttft_p50_ms} | {f.ttft_p99_ms} | {f.tpot_p50_ms} | {f.e2e_p50_ms} |" for f in v.loads]
    if v.error:
        lines += ["", f"error: {v.error}"]
    return lines
