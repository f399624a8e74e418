"""Is an engine really serving? Ready means a real completion came back, not /health alone
(users' pain #6: /health answers 200 while the workers are dead)."""

from __future__ import annotations

import re

import httpx

READY_PROMPT = "Hello, my name is"


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def completion_probe(base_url: str, model: str, api_key: str | None, timeout_s: float = 60.0,
                     prompt: str = READY_PROMPT, max_tokens: int = 8) -> str:
    """Send one greedy completion; return its text. Raises httpx errors or RuntimeError."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, headers=auth_headers(api_key), timeout=timeout_s)
    response.raise_for_status()
    choices = response.json().get("choices") or []
    if not choices:
        raise RuntimeError(f"completion returned no choices: {response.text[:200]}")
    return choices[0].get("text", "")


def health_ok(base_url: str, timeout_s: float = 2.0) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


ERROR_LINE = re.compile(r"\b[A-Za-z_.]*(Error|Exception)\b:?\s")


def engine_error(log_text: str) -> str:
    """The engine's own error message from its log: the last line naming an error, with the indented
    lines that continue it (pydantic puts the actual reason there). Pure."""
    lines = [line.rstrip() for line in log_text.splitlines() if line.strip()]
    for index in range(len(lines) - 1, -1, -1):
        if ERROR_LINE.search(lines[index]) and "Traceback" not in lines[index]:
            message = [lines[index].strip()]
            for follow in lines[index + 1:index + 4]:
                if not follow.startswith((" ", "\t")) or "further information" in follow:
                    break
                message.append(follow.strip())
            return " ".join(message)[:600]
    return lines[-1].strip()[-400:] if lines else "(the engine wrote nothing to its log)"
