"""`hpcserve baseline CONFIG`: the same benchmark on a single-node layout and on the configured
(multi-node) layout, one after the other, and a report with scaling efficiency (seed best practice:
know what the extra nodes buy before trusting them).

Writes RESULTS/logs/NAME/baseline/: single.json, multi.json, baseline.md and PNG plots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hpcserve import api
from hpcserve.benchmark.bench import BenchOptions, run_benchmark
from hpcserve.benchmark.compare import columns_by_load, scaling_efficiency
from hpcserve.benchmark.plots import write_plots
from hpcserve.benchmark.summary import BenchResult
from hpcserve.core.config import DeploymentConfig, Layout, load_config
from hpcserve.core.errors import StageError
from hpcserve.workflows.validate import single_node


def workers(cfg: DeploymentConfig) -> int:
    layout = cfg.parallelism if isinstance(cfg.parallelism, Layout) else Layout()
    return layout.workers_per_replica * layout.replicas


def serve_and_measure(cfg: DeploymentConfig, options: BenchOptions, on_event: Callable | None) -> BenchResult:
    result = api.up(cfg, on_event=on_event)
    try:
        if result.status is not api.RunStatus.READY:
            raise StageError("baseline", f"{cfg.name} did not become ready", str(result.run_dir))
        return run_benchmark(api.endpoints(cfg.name), replace(options, gpus=workers(cfg)), target=cfg.name,
                             command=["hpcserve", "baseline"])
    finally:
        api.down(cfg.name)


def report_lines(cfg: DeploymentConfig, single: BenchResult, multi: BenchResult) -> list[str]:
    """Markdown: one row per load point and layout, with the multi-node layout's scaling efficiency. Pure."""
    unit = "GPUs" if cfg.on_gpu else "CPU workers"
    lines = [f"# Baseline of {cfg.name}: single node against {cfg.cluster.nodes} nodes", "",
             f"Scaling efficiency = (multi-node output tok/s / single-node output tok/s) / ({unit} ratio).", "",
             "| load | layout | " + unit + " | req/s | output tok/s | TTFT p50 ms | TPOT p50 ms | scaling efficiency |",
             "|---|---|---|---|---|---|---|---|"]
    for label, columns in columns_by_load([("single node", single), ("configured", multi)]).items():
        base = columns[0]
        for column in columns:
            s = column.run.summary
            eff = scaling_efficiency(base, column) if column is not base else 1.0
            lines.append(f"| {label} | {column.name} | {column.gpus} | {s.request_throughput:.2f} | "
                         f"{s.output_throughput:.1f} | {_ms(s.ttft_ms.p50)} | {_ms(s.tpot_ms.p50)} | "
                         f"{'-' if eff is None else f'{eff:.2f}'} |")
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def baseline(config_path: str | Path, options: BenchOptions, on_event: Callable | None = None) -> Path:
    cfg = load_config(config_path)
    folder = Path(cfg.results_dir).resolve() / "logs" / cfg.name / "baseline"
    folder.mkdir(parents=True, exist_ok=True)
    single_cfg = single_node(cfg).model_copy(update={"name": f"{cfg.name}-single"[:40]})
    single = serve_and_measure(single_cfg, options, on_event)
    single.save(folder / "single.json")
    multi = serve_and_measure(cfg, options, on_event)
    multi.save(folder / "multi.json")
    for name, result in (("single", single), ("multi", multi)):
        for path in write_plots(result, folder):
            path.rename(folder / f"{name}-{path.name}")
    (folder / "baseline.md").write_text("\n".join(report_lines(cfg, single, multi)) + "\n")
    return folder

