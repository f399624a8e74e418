"""What users read of a plan: the explanation lines and the table of every candidate (`hpcserve plan`)."""

from __future__ import annotations

from rich.console import RenderableType
from rich.table import Table

from hpcserve.core.config import Layout
from hpcserve.core.tables import Notes, narrow_table, with_lines
from hpcserve.planning import throughput
from hpcserve.planning.model_shape import estimate_weights_bytes, kv_bytes_per_token
from hpcserve.planning.planner import Candidate, Plan, PlanSettings

GIB = 2**30


def size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 or n == 0 else f"{n / 2**20:.1f} MiB"


def layout_words(layout: Layout) -> str:
    return f"tensor {layout.tensor} x pipeline {layout.pipeline} x replicas {layout.replicas}"


def explain(p: Plan) -> list[str]:
    s, unit = p.settings, ("GPU" if p.cluster.gpus_per_node else "CPU worker")
    total = estimate_weights_bytes(p.shape, s.dtype, s.quantization)
    lines = [(f"Model: {size(total)} of weights in {s.dtype}{' (' + s.quantization + ')' if s.quantization else ''}, "
              f"{kv_bytes_per_token(p.shape, s.dtype, s.kv_cache_dtype) / 1024:.0f} KiB of KV cache per token; "
              f"max_model_len {s.max_model_len:,}")]
    best = p.best
    if best is None:
        return lines + ["No layout fits:"] + [f"  {layout_words(c.layout)}: {'; '.join(c.problems)}" for c in p.rejected] \
            + list(p.notes)
    lay = best.layout
    lines += [
        f"Best: {layout_words(lay)} ({lay.workers_per_replica * lay.replicas} {unit}s), score {best.score:.2f}",
        (f"Weights: {size(best.weights_bytes_per_worker)} per {unit}; reserve for activations and runtime "
         f"{size(best.reserve_bytes_per_worker)}; KV cache {size(best.kv_bytes_per_worker)} per {unit}"),
        f"KV cache: {best.kv_tokens_per_replica:,} tokens per replica, {best.kv_tokens_per_replica * lay.replicas:,} in all",
        (f"Concurrent sequences at max_model_len {s.max_model_len:,}: {best.max_concurrency:.1f} per replica, "
         f"{best.max_concurrency * lay.replicas:.1f} in all"),
    ]
    if s.under_load:
        lines += load_lines(p, best)
    if len(p.ranked) > 1:
        lines.append(why_better(best, p.ranked[1], s))
    if not p.cluster.gpus_per_node:
        lines.append("CPU: KV cache is VLLM_CPU_KVCACHE_SPACE per worker; host memory for weights is not checked")
    return lines + list(p.notes)


def load_lines(p: Plan, best: Candidate) -> list[str]:
    s = p.settings
    if s.expected_concurrency is not None:
        source = f"{s.expected_concurrency:g} requests in flight in all (expected concurrency), " \
                 f"{best.in_flight_per_replica:.1f} per replica"
    else:
        source = f"{best.in_flight_per_replica:g} requests in flight per replica (autoscale: a full batch plus the queue target)"
    lines = [(f"Load: {source}; each replica runs {best.batch_per_replica:.1f} and reaches {best.load_factor:.2f} of "
              f"its peak (half the peak at {throughput.C_HALF * best.layout.pipeline:.0f} running)")]
    at_capacity = max(p.ranked, key=lambda c: (round(c.capacity, 9), c.kv_tokens_per_replica))
    if at_capacity.layout != best.layout:
        lines.append(f"At capacity (saturated) {layout_words(at_capacity.layout)} would win "
                     f"({at_capacity.capacity:.2f} against {best.capacity:.2f}): it needs more requests in flight")
    return lines


def why_better(best: Candidate, other: Candidate, s: PlanSettings) -> str:
    reasons = []
    if s.under_load and other.load_factor < best.load_factor:
        reasons.append(f"with {other.in_flight_per_replica:.1f} in flight per replica its replicas reach "
                       f"{other.load_factor:.2f} of their peak against {best.load_factor:.2f}")
    if other.tp_efficiency < best.tp_efficiency:
        reasons.append(f"its tensor {other.layout.tensor} runs each worker at {other.tp_efficiency:.2f} of TP=1 "
                       f"(communication) against {best.tp_efficiency:.2f}")
    if other.pp_efficiency < best.pp_efficiency:
        reasons.append(f"its pipeline {other.layout.pipeline} loses {1 - other.pp_efficiency:.0%} to bubbles")
    if other.kv_factor < best.kv_factor:
        reasons.append(f"its KV cache holds only {other.max_concurrency:.1f} sequences of max_model_len per replica "
                       f"(fewer than {s.min_concurrent_seqs:g} caps batching)")
    if not reasons:
        reasons.append("it uses fewer workers in all" if other.score < best.score else "it ties and holds fewer KV tokens")
    return (f"Runner-up: {layout_words(other.layout)}, score {other.score:.2f}: " + "; ".join(reasons))


def render_plan_table(p: Plan) -> RenderableType:
    """Every candidate, best first, rejected last; why a layout is rejected goes below the table.
    Reads at 80 columns (tests render it so)."""
    table, notes = plan_table(p)
    unit = "GPU" if p.cluster.gpus_per_node else "worker"
    legend = (f"weights, KV in GiB per {unit}; KV tokens, seqs at max len"
              + (", in flight" if p.settings.under_load else "") + ": per replica")
    return with_lines(table, [legend, *notes.lines()])


def plan_table(p: Plan) -> tuple[Table, Notes]:
    load = p.settings.under_load
    title = f"Layouts at max_model_len {p.settings.max_model_len:,} ({p.settings.dtype})"
    columns = ["#", "TP", "PP", "reps", "weights", "KV", "KV tokens", "seqs"]
    columns += ["in flight", "of peak", "cap"] if load else []
    table = narrow_table(title, *columns, "score", "note", left=("note",))
    notes = Notes()
    for rank, c in enumerate(p.ranked + p.rejected, start=1):
        note = notes.add("; ".join(c.problems)) if c.problems else ("best" if rank == 1 else "")
        cells = [str(rank) if c.fits else "-", str(c.layout.tensor), str(c.layout.pipeline), str(c.layout.replicas),
                 f"{c.weights_bytes_per_worker / GIB:.1f}", f"{c.kv_bytes_per_worker / GIB:.1f}",
                 f"{c.kv_tokens_per_replica:,}", f"{c.max_concurrency:.1f}"]
        if load:
            cells += [f"{c.in_flight_per_replica:.1f}", f"{c.load_factor:.2f}", f"{c.capacity:.2f}"]
        table.add_row(*cells, f"{c.score:.2f}", note, style="dim" if c.problems else None)
    return table, notes
