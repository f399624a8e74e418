"""The one client helper for OpenAI-compatible engines and endpoints: where one is (Endpoint), the key
header, and whether it really serves. Ready means a real completion came back, not /health alone (users'
pain #6: /health answers 200 while the workers are dead)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from hpcserve.core.keys import bearer
from hpcserve.engine.metrics import kv_cache_tokens

READY_PROMPT = "Hello, my name is"



@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible endpoint: base URL without /v1, served model name, key (or None)."""

    base_url: str
    model: str | None
    api_key: str | None


def completion_probe(base_url: str, model: str, api_key: str | None, timeout_s: float = 60.0,
                     prompt: str = READY_PROMPT, max_tokens: int = 8) -> str:
    """Send one greedy completion; return its text. Raises httpx errors or RuntimeError."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, headers=bearer(api_key), timeout=timeout_s)
    response.raise_for_status()
    choices = response.json().get("choices") or []
    if not choices:
        raise RuntimeError(f"completion returned no choices: {response.text[:200]}")
    return choices[0].get("text", "")


def kv_cache_size(base_url: str, api_key: str | None, timeout_s: float = 5.0) -> int | None:
    """The tokens the engine's KV cache holds, from its /metrics; None when it does not say or answer."""
    try:
        response = httpx.get(f"{base_url}/metrics", headers=bearer(api_key), timeout=timeout_s)
        return kv_cache_tokens(response.text) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def health_ok(base_url: str, timeout_s: float = 2.0) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False
