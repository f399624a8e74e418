"""PNG plots of a benchmark result (matplotlib, Agg backend: works on login nodes without a display)."""

from __future__ import annotations

from pathlib import Path

from hpcserve.benchmark.summary import BenchResult, BenchRun


def _pyplot():
    """Imported on first use: matplotlib is slow to import and only plots need it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(result: BenchResult, folder: str | Path) -> list[Path]:
    """Both plots into `folder` (created); returns the files written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return [plot_throughput_latency(result, folder / "throughput_latency.png"),
            plot_ttft_distribution(result, folder / "ttft_distribution.png")]


def plot_throughput_latency(result: BenchResult, path: Path) -> Path:
    """The sweep's trade-off: output tokens/s against median and p99 latency, one point per load."""
    plt = _pyplot()
    runs = [run for run in result.runs if run.summary.completed]
    throughput = [run.summary.output_throughput for run in runs]
    figure, (ttft_axes, e2e_axes) = plt.subplots(1, 2, figsize=(11, 4.5))
    for axes, metric, title in ((ttft_axes, "ttft_ms", "time to first token"), (e2e_axes, "e2e_ms", "end-to-end")):
        for quantile, style in (("p50", "o-"), ("p99", "s--")):
            axes.plot(throughput, [getattr(getattr(run.summary, metric), quantile) for run in runs], style,
                      label=quantile)
        _label_points(axes, runs, throughput, [getattr(run.summary, metric).p50 for run in runs])
        axes.set(xlabel="output tokens/s", ylabel="ms", title=title)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(f"{result.target} ({result.date})")
    return _save(plt, figure, path)


def _label_points(axes, runs: list[BenchRun], xs: list[float], ys: list[float]) -> None:
    for run, x, y in zip(runs, xs, ys):
        axes.annotate(run.label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)


def plot_ttft_distribution(result: BenchResult, path: Path) -> Path:
    """Histogram and CDF of time to first token, one series per load point."""
    plt = _pyplot()
    figure, (hist_axes, cdf_axes) = plt.subplots(1, 2, figsize=(11, 4.5))
    for run in result.runs:
        ttfts = sorted(1000.0 * r.ttft_s for r in run.requests if r.ok and r.ttft_s is not None)
        if not ttfts:
            continue
        hist_axes.hist(ttfts, bins=30, alpha=0.5, label=run.label)
        cdf_axes.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=run.label)
    hist_axes.set(xlabel="TTFT (ms)", ylabel="requests", title="TTFT histogram")
    cdf_axes.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.02))
    for axes in (hist_axes, cdf_axes):
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7)
    return _save(plt, figure, path)


def _save(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
