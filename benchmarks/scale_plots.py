"""Plots and a Markdown table from benchmarks/scale.py's JSON (before and after), for benchmarks/results/scale.md.

    .venv/bin/python benchmarks/scale_plots.py before.json after.json --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def points(path: Path) -> list[dict]:
    return sorted(json.loads(path.read_text())["points"], key=lambda p: p["replicas"])


def get(point: dict, *keys, default=None):
    for key in keys:
        if not isinstance(point, dict) or key not in point or point[key] is None:
            return default
        point = point[key]
    return point


def latency_at(point: dict, rate: float) -> dict:
    return next((p for p in point.get("latency", []) if p["rate"] == rate), {})


def table(runs: dict[str, list[dict]]) -> str:
    rows = ["| code | replicas | ready (s) | round p50 / p99 (ms) | step p99 (ms) | controller CPU | probe req/s | "
            "/metrics MB/s | lost replica out of the router (s) | replacement joined (s) | failed (kill) | "
            "rounds p99 during the kill (ms) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, pts in runs.items():
        for p in pts:
            idle, kill = p.get("idle", {}), p.get("kill", {})
            fmt = lambda v, f="{:.0f}": f.format(v) if isinstance(v, (int, float)) else "-"  # noqa: E731
            rows.append(
                f"| {name} | {p['replicas']} | {fmt(p.get('ready_s'), '{:.1f}')} | "
                f"{fmt(idle.get('round_ms_p50'))} / {fmt(idle.get('round_ms_p99'))} | {fmt(idle.get('step_ms_p99'))} | "
                f"{fmt(idle.get('controller_cpu'), '{:.2f}')} | "
                f"{fmt((idle.get('health_per_s') or 0) + (idle.get('metrics_per_s') or 0))} | "
                f"{fmt((idle.get('metrics_bytes_per_s') or 0) / 1e6, '{:.1f}')} | "
                f"{fmt(kill.get('out_of_router_s_max'), '{:.1f}')} | {fmt(kill.get('replacement_join_s_max'), '{:.1f}')} | "
                f"{get(kill, 'load', 'failed', default='-')} of {get(kill, 'load', 'ok', default=0) + get(kill, 'load', 'failed', default=0)} | "
                f"{fmt(kill.get('round_ms_p99'))} |")
    return "\n".join(rows)


def latency_table(runs: dict[str, list[dict]]) -> str:
    rows = ["| code | replicas | rate asked (req/s) | direct p50 / p99 (ms) | router p50 / p99 (ms) | added p50 / p99 (ms) | "
            "achieved router req/s | failed |", "|---|---|---|---|---|---|---|---|"]
    for name, pts in runs.items():
        for p in pts:
            for lat in p.get("latency", []):
                d, r = lat["direct"], lat["router"]
                rows.append(f"| {name} | {p['replicas']} | {lat['rate']:g} | {d['p50_ms']:.2f} / {d['p99_ms']:.1f} | "
                            f"{r['p50_ms']:.2f} / {r['p99_ms']:.1f} | {lat['added_p50_ms']:+.2f} / {lat['added_p99_ms']:+.1f} | "
                            f"{r['rps']:.0f} | {d['failed']} / {r['failed']} |")
            if p.get("ceiling"):
                c = p["ceiling"]
                rows.append(f"| {name} | {p['replicas']} | ceiling, {c['concurrency']} clients | "
                            f"{c['direct']['p50_ms']:.1f} / {c['direct']['p99_ms']:.1f} | {c['router']['p50_ms']:.1f} / "
                            f"{c['router']['p99_ms']:.1f} | | **{c['router']['rps']:.0f}** (direct {c['direct']['rps']:.0f}) | "
                            f"{c['direct']['failed']} / {c['router']['failed']} |")
    return "\n".join(rows)


def held(point: dict) -> bool:
    """The machine kept up with this rate: no failures, the load generator at most 100 ms late."""
    return all(point[m]["failed"] == 0 and point[m]["lateness_p99_ms"] < 100 for m in ("direct", "router"))


def plot(runs: dict[str, list[dict]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    panels = [("round_ms_p99", "controller round p99 (ms)", lambda p: get(p, "idle", "round_ms_p99"), True),
              ("controller_cpu", "controller CPU (cores)", lambda p: get(p, "idle", "controller_cpu"), False),
              ("out_of_router", "lost replica out of the router (s)", lambda p: get(p, "kill", "out_of_router_s_max"), False),
              ("ceiling", "router ceiling (req/s, 64 clients)", lambda p: get(p, "ceiling", "router", "rps"), False)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (_, label, value, log) in zip(axes, panels):
        for name, pts in runs.items():
            xs = [p["replicas"] for p in pts if value(p) is not None]
            ys = [value(p) for p in pts if value(p) is not None]
            if xs:
                ax.plot(xs, ys, marker="o", label=name)
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("replicas")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = out / "scale-control-plane.png"
    fig.savefig(path, dpi=110)
    made.append(path)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, pts in runs.items():
        for p in pts:
            # Only rates this machine kept up with: the load generator on schedule, nothing failed
            lats = [lt for lt in p.get("latency", []) if held(lt)]
            if lats:
                axes[0].plot([lt["router"]["rps"] for lt in lats], [lt["added_p50_ms"] for lt in lats], marker="o",
                             label=f"{name}, {p['replicas']} replicas")
                axes[1].plot([lt["router"]["rps"] for lt in lats], [lt["router"]["p99_ms"] for lt in lats], marker="o",
                             label=f"{name}, {p['replicas']} replicas")
    axes[0].set_title("router's added latency, p50 (ms)", fontsize=9)
    axes[1].set_title("latency through the router, p99 (ms, log)", fontsize=9)
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("requests/s achieved through the router (rates it kept up with)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "scale-router-latency.png"
    fig.savefig(path, dpi=110)
    made.append(path)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="JSON files; named by their file name")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    runs = {path.stem: points(path) for path in args.runs}
    print(table(runs))
    print()
    print(latency_table(runs))
    for path in plot(runs, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
