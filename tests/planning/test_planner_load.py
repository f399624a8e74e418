"""The planner under offered load: scored at the requests in flight a deployment expects, on the
H200 measurements of benchmarks/results/gpu.md (run B) and ../shared/gpu/README.md (run A): Llama-3.1-8B shape,
vLLM 0.26, 512 prompt / 128 output tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcserve.core.config import ClusterSpec, Layout, parse_config
from hpcserve.core.errors import ConfigError
from hpcserve.planning import throughput
from hpcserve.planning.model_shape import ModelShape
from hpcserve.planning.planner import evaluate, plan, plan_for_config
from hpcserve.planning.report import explain, plan_table

MODELS = Path(__file__).parents[1] / "data" / "models"
LLAMA_8B = ModelShape.from_config(json.loads((MODELS / "llama-3.1-8b.json").read_text()))
LLAMA_70B = ModelShape.from_config(json.loads((MODELS / "llama-3.1-70b.json").read_text()))
H200_1x2 = ClusterSpec(scheduler="slurm", nodes=1, gpus_per_node=2, gpu_memory_gb=141)
H200_1x1 = ClusterSpec(scheduler="slurm", nodes=1, gpus_per_node=1, gpu_memory_gb=141)
A100_1x8 = ClusterSpec(scheduler="slurm", nodes=1, gpus_per_node=8, gpu_memory_gb=80)
TP2, TWO_TP1 = Layout(tensor=2, replicas=1), Layout(tensor=1, replicas=2)
BENCH = {"max_model_len": 2048}  # the benchmark's setting


def scores(concurrency: float | None, shape: ModelShape = LLAMA_8B, cluster: ClusterSpec = H200_1x2, **options) -> dict:
    p = plan(shape, cluster, expected_concurrency=concurrency, **{**BENCH, **options})
    return {c.layout: c.score for c in p.ranked}


def test_at_concurrency_32_tp2_beats_two_replicas_by_the_measured_margin():
    s = scores(32)
    assert plan(LLAMA_8B, H200_1x2, expected_concurrency=32, **BENCH).best_layout() == TP2
    # measured (run B, hpcserve): TP=2 5173.6 tok/s, 2 x TP=1 4822.8 tok/s: 7% more
    assert s[TP2] / s[TWO_TP1] == pytest.approx(5173.6 / 4822.8, rel=0.005)


def test_at_concurrency_32_tp2_against_one_tp1_gpu_matches_run_a():
    one = evaluate(LLAMA_8B, Layout(tensor=1), H200_1x1, expected_concurrency=32, **BENCH)
    # measured (run A, plain vLLM): TP=1 3707 tok/s, TP=2 4469 tok/s, both at 32 in flight
    assert scores(32)[TP2] / one.score == pytest.approx(4469 / 3707, rel=0.01)
    assert one.score * throughput.PEAK_TP1_TOKS == pytest.approx(3707, rel=1e-6)  # the calibration anchor
    assert scores(32)[TP2] * throughput.PEAK_TP1_TOKS == pytest.approx(4469, rel=0.01)


def test_at_high_concurrency_replicas_win_again():
    s = scores(256)
    assert max(s, key=s.get) == TWO_TP1
    assert s[TWO_TP1] / s[TP2] > 1.2
    # the crossover lies between the measured load and saturation
    assert scores(48)[TP2] > scores(48)[TWO_TP1] and scores(96)[TWO_TP1] > scores(96)[TP2]


def test_without_a_load_the_capacity_ranking_stays():
    p = plan(LLAMA_8B, H200_1x2, **BENCH)
    assert p.best_layout() == TWO_TP1
    assert [round(c.score, 2) for c in p.ranked] == [2.0, 1.2]
    assert all(c.in_flight_per_replica is None for c in p.ranked)


def test_low_load_prefers_tensor_parallel_for_every_size():
    for concurrency in (1, 4, 16):
        assert max(scores(concurrency), key=scores(concurrency).get) == TP2


def test_kv_factor_applies_under_load_as_at_capacity():
    # 70B at its full 128k context on 8 x 80 GB: TP=4 replicas hold 3.7 sequences each, TP=8 holds 10.8
    p = plan(LLAMA_70B, A100_1x8, expected_concurrency=1024)
    tp4 = next(c for c in p.ranked if c.layout == Layout(tensor=4, replicas=2))
    assert tp4.in_flight_per_replica == 512 and tp4.batch_per_replica == 256  # max_num_seqs
    assert tp4.score == pytest.approx(tp4.capacity * tp4.load_factor)
    assert tp4.kv_factor == pytest.approx(3.7 / 16, abs=0.01)
    assert p.best_layout() == Layout(tensor=8, replicas=1)
    assert "holds only 3.7 sequences of max_model_len" in "\n".join(explain(p))


def test_70b_on_one_node_tp8_at_moderate_load_two_tp4_replicas_at_high_load():
    at = {c: plan(LLAMA_70B, A100_1x8, max_model_len=8192, expected_concurrency=c).best_layout() for c in (32, 1024)}
    assert at == {32: Layout(tensor=8, replicas=1), 1024: Layout(tensor=4, replicas=2)}


def test_max_num_seqs_caps_the_batch():
    c = evaluate(LLAMA_8B, TP2, H200_1x2, expected_concurrency=1000, max_num_seqs=128, **BENCH)
    assert c.batch_per_replica == 128
    assert c.load_factor == pytest.approx(128 / (128 + throughput.C_HALF))


def test_pipeline_stages_need_more_requests_in_flight():
    assert throughput.load_factor(32, 2) < throughput.load_factor(32, 1)
    assert throughput.load_factor(64, 2) == pytest.approx(throughput.load_factor(32, 1))


def test_c_half_comes_from_the_measurements():
    e, rho = 0.60, 5173.6 / 4822.8
    assert throughput.C_HALF == pytest.approx(32 * (rho - e) / (2 * e - rho))
    assert 100 < throughput.C_HALF < 130


def test_expected_concurrency_must_be_positive():
    with pytest.raises(ConfigError, match="must be above 0"):
        plan(LLAMA_8B, H200_1x2, expected_concurrency=0, **BENCH)


def deployment(**extra) -> dict:
    return {"name": "bench", "model": {"path": "/models/llama-3.1-8b", "max_model_len": 2048},
            "cluster": {"scheduler": "slurm", "nodes": 1, "gpus_per_node": 2, "gpu_memory_gb": 141}, **extra}


def test_plan_for_config_reads_serve_expected_concurrency_and_explains_it():
    cfg = parse_config(deployment(serve={"expected_concurrency": 32}))
    p = plan_for_config(cfg, json.loads((MODELS / "llama-3.1-8b.json").read_text()))
    assert p.settings.expected_concurrency == 32 and p.best_layout() == TP2
    text = "\n".join(explain(p))
    assert "Load: 32 requests in flight in all (expected concurrency), 32.0 per replica" in text
    assert "At capacity (saturated) tensor 1 x pipeline 1 x replicas 2 would win" in text
    assert "with 16.0 in flight per replica its replicas reach 0.12 of their peak against 0.21" in text
    assert plan_table(p)[0].columns[8].header == "in flight"  # per replica: the legend below the table says so


def test_autoscale_scores_replicas_at_a_full_batch():
    cfg = parse_config(deployment(autoscale={"min": 1, "max": 4, "target_queue": 4},
                                  engine={"args": ["--max-num-seqs", "64"]}))
    p = plan_for_config(cfg, json.loads((MODELS / "llama-3.1-8b.json").read_text()))
    assert p.settings.expected_concurrency is None and p.settings.replica_concurrency == 68
    assert all(c.batch_per_replica == 64 for c in p.ranked)
    assert p.best_layout() == TWO_TP1  # saturated replicas: the capacity ranking
    assert "(autoscale: a full batch plus the queue target)" in "\n".join(explain(p))


def test_expected_concurrency_wins_over_autoscale():
    cfg = parse_config(deployment(autoscale={"target_queue": 4}, serve={"expected_concurrency": 8}))
    p = plan_for_config(cfg, json.loads((MODELS / "llama-3.1-8b.json").read_text()))
    assert p.settings.expected_concurrency == 8 and p.best_layout() == TP2
