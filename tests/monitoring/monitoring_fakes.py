"""Stand-ins shared by the monitoring tests: the saved vLLM text, node samples, replicas behind a MockTransport."""

from __future__ import annotations

import types
from pathlib import Path

import httpx

DATA = Path(__file__).parent / "data"
TEXT = (DATA / "vllm_metrics.txt").read_text()  # curl {url}/metrics of `hpcserve up examples/local.yaml`
REPLICA = {"index": 0, "url": "http://127.0.0.1:8000", "model": "tiny", "nodes": ["vm"], "healthy": True}


def with_tokens(generated: float, prompt: float = 8.0) -> str:
    return (TEXT.replace('vllm:generation_tokens_total{engine="0",model_name="tiny"} 8.0',
                         f'vllm:generation_tokens_total{{engine="0",model_name="tiny"}} {generated}')
            .replace('vllm:prompt_tokens_total{engine="0",model_name="tiny"} 8.0',
                     f'vllm:prompt_tokens_total{{engine="0",model_name="tiny"}} {prompt}'))


def sample(t: float, cpu: float = 50.0, gpus: list | None = None) -> dict:
    return {"time": t, "host": "n1", "cpu_pct": cpu, "ram_used_mb": 1024, "net_sent_mb": 1.0, "net_recv_mb": 2.0,
            "engine_rss_mb": 512.0, "engine_cpu_pct": 90.0, "gpus": gpus}


class Replicas:
    """Two replicas: :8000 serves the saved text with a growing token counter, :8001 refuses connections."""

    def __init__(self):
        self.generated = 8.0
        self.auth: list[str | None] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.auth.append(request.headers.get("Authorization"))
        if request.url.port == 8001:
            raise httpx.ConnectError("connection refused", request=request)
        self.generated += 20
        return httpx.Response(200, text=with_tokens(self.generated))


def fake_status(run_dir: Path):
    reps = [dict(REPLICA), {**REPLICA, "index": 1, "url": "http://127.0.0.1:8001", "healthy": False}]
    return lambda name: types.SimpleNamespace(name=name, scheduler="local", status="degraded", stage="ready",
                                              runner="driver pid 1", run_dir=str(run_dir), replicas=reps, error=None,
                                              job_id=None)
