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


def served_model_names(endpoint: Endpoint, timeout_s: float = 5.0) -> list[str] | None:
    """The models GET /v1/models lists; None when it does not answer with such a list."""
    try:
        response = httpx.get(f"{endpoint.base_url}/v1/models", headers=bearer(endpoint.api_key), timeout=timeout_s,
                             trust_env=False)
        response.raise_for_status()
        return [card["id"] for card in response.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def health_ok(base_url: str, timeout_s: float = 2.0) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


SLEEP_TIMEOUT_S = 120.0  # offloading a large model's weights to host RAM takes a while; so does the way back


def engine_sleep(base_url: str, api_key: str | None, level: int = 1, timeout_s: float = SLEEP_TIMEOUT_S) -> bool:
    """vLLM's POST /sleep?level=1: weights to host RAM, KV cache freed (the process and its allocation stay).
    True when it sleeps; False when the engine has no sleep mode (404: started without --enable-sleep-mode or
    VLLM_SERVER_DEV_MODE, or vLLM on CPU) or refused. Raises httpx errors when it does not answer."""
    response = httpx.post(f"{base_url}/sleep", params={"level": level}, headers=bearer(api_key), timeout=timeout_s)
    return response.status_code == 200


def engine_wake_up(base_url: str, api_key: str | None, timeout_s: float = SLEEP_TIMEOUT_S) -> bool:
    """vLLM's POST /wake_up: weights back on the GPU, KV cache reallocated. True when it answered awake."""
    response = httpx.post(f"{base_url}/wake_up", headers=bearer(api_key), timeout=timeout_s)
    if response.status_code != 200:
        return False
    try:
        return response.json().get("status", "awake") == "awake"
    except ValueError:
        return True


def engine_is_sleeping(base_url: str, api_key: str | None, timeout_s: float = 5.0) -> bool | None:
    """vLLM's GET /is_sleeping; None when the engine has no sleep mode (404) or does not answer."""
    try:
        response = httpx.get(f"{base_url}/is_sleeping", headers=bearer(api_key), timeout=timeout_s)
        return bool(response.json().get("is_sleeping")) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
