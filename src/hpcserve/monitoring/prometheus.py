"""Prometheus metrics of a deployment, from a Gatherer's Snapshot (monitoring/metrics.py):

    DeploymentCollector   a prometheus_client collector (hpcserve_* metrics, and vLLM's own gauges and
                          counters with `deployment` and `replica` labels added)
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hpcserve.core.statuses import RunStatus
from hpcserve.monitoring.metrics import (
    MIB,
    Gatherer,
    NodeMetrics,
    ReplicaMetrics,
    Snapshot,
)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def node_families(deployment: str, nodes: list[NodeMetrics]) -> list[Metric]:
    """Node and GPU gauges; a stale node only reports its sample age (its last values would lie)."""
    node = ["deployment", "node"]
    gpu = ["deployment", "node", "gpu"]
    fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "age": _gauge("hpcserve_node_sample_age_seconds", "Seconds since the node's sampler last wrote", node),
        "cpu": _gauge("hpcserve_node_cpu_percent", "CPU use of the whole node (100 = all cores)", node),
        "ram": _gauge("hpcserve_node_ram_used_bytes", "RAM in use on the node", node),
        "rss": _gauge("hpcserve_engine_rss_bytes", "Resident memory of the engine processes on the node", node),
        "ecpu": _gauge("hpcserve_engine_cpu_percent", "CPU of the engine processes on the node (100 = one core)", node),
        "sent": CounterMetricFamily("hpcserve_node_network_sent_bytes", "Bytes sent by the node (since boot)",
                                    labels=node),
        "recv": CounterMetricFamily("hpcserve_node_network_received_bytes", "Bytes received by the node (since boot)",
                                    labels=node),
        "gutil": _gauge("hpcserve_gpu_utilization_percent", "GPU utilisation (NVML)", gpu),
        "gused": _gauge("hpcserve_gpu_memory_used_bytes", "GPU memory in use (NVML)", gpu),
        "gtotal": _gauge("hpcserve_gpu_memory_total_bytes", "GPU memory in all (NVML)", gpu),
    }
    for n in nodes:
        labels = [deployment, n.host]
        if n.age_s is not None:
            fams["age"].add_metric(labels, n.age_s)
        if n.stale or n.latest is None:
            continue
        s = n.latest
        for key, field_name, scale in (("cpu", "cpu_pct", 1), ("ram", "ram_used_mb", MIB),
                                       ("rss", "engine_rss_mb", MIB), ("ecpu", "engine_cpu_pct", 1),
                                       ("sent", "net_sent_mb", MIB), ("recv", "net_recv_mb", MIB)):
            if s.get(field_name) is not None:
                fams[key].add_metric(labels, float(s[field_name]) * scale)
        for g in s.get("gpus") or []:
            glabels = labels + [str(g.get("index", 0))]
            fams["gutil"].add_metric(glabels, float(g.get("util_pct", 0)))
            fams["gused"].add_metric(glabels, float(g.get("mem_used_mb", 0)) * MIB)
            fams["gtotal"].add_metric(glabels, float(g.get("mem_total_mb", 0)) * MIB)
    return list(fams.values())


def replica_families(deployment: str, replicas: list[ReplicaMetrics]) -> list[Metric]:
    rep = ["deployment", "replica", "url"]
    up = _gauge("hpcserve_replica_up", "1 when the replica's /metrics answered, else 0", rep)
    healthy = _gauge("hpcserve_replica_healthy", "1 when the replica's /health answered 200, else 0", rep)
    gen = _gauge("hpcserve_replica_generation_tokens_per_second",
                 "Generated tokens per second, from vLLM's counter between the last two scrapes", rep)
    prompt = _gauge("hpcserve_replica_prompt_tokens_per_second",
                    "Prompt tokens per second, from vLLM's counter between the last two scrapes", rep)
    for r in replicas:
        labels = [deployment, str(r.index), r.url]
        up.add_metric(labels, 1.0 if r.up else 0.0)
        if r.healthy is not None:
            healthy.add_metric(labels, 1.0 if r.healthy else 0.0)
        if r.generation_tokens_per_s is not None:
            gen.add_metric(labels, r.generation_tokens_per_s)
        if r.prompt_tokens_per_s is not None:
            prompt.add_metric(labels, r.prompt_tokens_per_s)
    return [up, healthy, gen, prompt]


def engine_families(deployment: str, replicas: list[ReplicaMetrics]) -> list[Metric]:
    """vLLM's gauges and counters under their own names, one family across replicas, each sample with
    `deployment` and `replica` labels added in front of vLLM's own."""
    merged: dict[str, Metric] = {}
    for r in replicas:
        for m in r.engine:
            for labels, value in m.samples:
                names = ["deployment", "replica"] + [k for k, _ in labels if k not in ("deployment", "replica")]
                values = [deployment, str(r.index)] + [v for k, v in labels if k not in ("deployment", "replica")]
                family = merged.get(m.name)
                if family is None:
                    family = merged[m.name] = Metric(m.name, m.doc, m.kind)
                family.add_sample(m.name + ("_total" if m.kind == "counter" else ""), dict(zip(names, values)), value)
    return list(merged.values())


def families(snapshot: Snapshot) -> list[Metric]:
    """Every metric of a snapshot. Pure."""
    name = snapshot.deployment["name"]
    status = str(snapshot.deployment.get("status"))
    ready = _gauge("hpcserve_deployment_ready", "1 when the deployment's status is ready, else 0",
                   ["deployment", "status"])
    ready.add_metric([name, status], 1.0 if status == RunStatus.READY else 0.0)
    return [ready, *replica_families(name, snapshot.replicas), *node_families(name, snapshot.nodes),
            *engine_families(name, snapshot.replicas)]


class DeploymentCollector:
    """Register in a CollectorRegistry; each collection takes a (possibly cached) snapshot."""

    def __init__(self, gatherer: Gatherer):
        self.gatherer = gatherer

    def collect(self) -> Iterable[Metric]:
        return families(self.gatherer.snapshot())
