"""The data plane's side of tenancy (hpcserve.tenancy): its settings file, a request's Visit (who sent it,
for which model, and what its answer used), and the refusals in OpenAI's error shape. The decisions
themselves are tenancy's (view.TenantView, limits); here they meet the HTTP request.

The settings come as a JSON file (--tenancy FILE, tenancy.settings.TenancySettings), written by the
controller from the config's tenancy section.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from hpcserve.endpoint.dataplane import wire
from hpcserve.tenancy.limits import LimitHit
from hpcserve.tenancy.records import UsageRow
from hpcserve.tenancy.settings import TenancySettings
from hpcserve.tenancy.store import open_store
from hpcserve.tenancy.view import Tenant, TenantView

USAGE_TAIL = 4096  # vLLM ends a whole answer with its usage: only the tail is searched
_DECODER = json.JSONDecoder()
_COUNT = rb"(0|[1-9][0-9]*)"  # a JSON integer >= 0 (JSON has no leading zeros), captured
_TOTAL = rb"(?:0|[1-9][0-9]*)"
# A usage object of prompt_tokens, then total_tokens and completion_tokens in either order, then perhaps
# prompt_tokens_details (null, or cached_tokens alone), nothing else: what vLLM writes. Only what JSON reads as
# these integers matches (a count can only end at the ',' or '}' that follows), so a match gives what the
# decoder would.
USAGE_SHAPE = re.compile(
    rb'"usage": ?\{"prompt_tokens": ?' + _COUNT
    + rb', ?"(?:total_tokens": ?' + _TOTAL + rb', ?"completion_tokens": ?' + _COUNT
    + rb'|completion_tokens": ?' + _COUNT + rb', ?"total_tokens": ?' + _TOTAL + rb')'
    + rb'(?:, ?"prompt_tokens_details": ?(?:null|\{"cached_tokens": ?' + _COUNT + rb'\}))?\}')
_new_row = tuple.__new__


def tenant_view(settings: TenancySettings, owner_key: str | None) -> TenantView:
    return TenantView(lambda: open_store(settings.database), owner_key, settings.limits, settings.usage_flush_s,
                      shares=settings.shares, pause_streams=settings.pause_streams)


@dataclass(slots=True)
class Visit:
    """One request of a tenant, from its arrival to the end of its answer."""

    tenant: Tenant
    route: str
    model: str | None
    started_at: float  # epoch seconds
    started: float  # monotonic
    first_byte: float | None = None  # monotonic: when the answer's first byte went to the client
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    migrated: bool = False

    def whole_answer(self, body: bytes) -> None:
        """Token counts from a whole answer's `usage` (completions, chat, embeddings): the usual shape by one
        match (USAGE_SHAPE), any other through the JSON decoder (answer_counts)."""
        self.first_byte = time.monotonic()
        at = body.rfind(b'"usage"', -USAGE_TAIL)
        if at < 0:
            return
        match = USAGE_SHAPE.match(body, at)
        if match is not None:
            prompt, completion, completion_later, cached = match.groups()
            self.prompt_tokens, self.completion_tokens = int(prompt), int(completion or completion_later)
            if cached is not None:
                self.cached_tokens = int(cached)
            return
        counts = answer_counts(body, at)
        if counts is not None:
            self.prompt_tokens, self.completion_tokens, self.cached_tokens = counts

    def stream_counts(self, prompt: int | None, generated: int | None, migrated: bool) -> None:
        """A stream's counts, from the token ids it carried (across its migrations: the original prompt, and
        every token the client got, once)."""
        self.prompt_tokens = prompt
        self.completion_tokens = generated
        self.migrated = migrated

    def row(self, status: int, now: float) -> UsageRow:
        tenant = self.tenant
        ttft = self.first_byte - self.started if self.first_byte is not None else None
        # tuple.__new__ straight: UsageRow's own __new__ is a Python function that only passes its arguments on
        return _new_row(UsageRow, (self.started_at, tenant.key_id, tenant.user, tenant.project, self.model, self.route,
                                   status, self.prompt_tokens, self.cached_tokens, self.completion_tokens, ttft,
                                   now - self.started, self.migrated))


def answer_counts(body: bytes, at: int) -> tuple[int | None, int | None, int | None] | None:
    """(prompt, completion, cached) tokens of a whole JSON answer's `usage`, whose key is at `at`, as the JSON
    decoder reads them: each None where the usage has no such count; None without a usage object."""
    usage = answer_usage(body, at)
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details")
    return (_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")),
            _count(details.get("cached_tokens")) if isinstance(details, dict) else None)


def answer_usage(body: bytes, at: int) -> dict | None:
    """The `usage` object of a whole JSON answer whose key `"usage"` is at `at`, else None."""
    start = body.find(b"{", at)
    if start < 0:
        return None
    try:
        usage, _ = _DECODER.raw_decode(body[start:].decode("utf-8", "replace"))
    except ValueError:
        return None
    return usage if isinstance(usage, dict) else None


def _count(value) -> int | None:
    """A token count of JSON as a count: an integer (not a boolean: `type`, as JSON makes no other int), >= 0."""
    return value if type(value) is int and value >= 0 else None


def limit_refusal(hit: LimitHit) -> tuple[int, bytes, dict[str, str] | None]:
    """status, OpenAI-shaped body, headers (Retry-After for a rate)."""
    kind = "rate_limit_exceeded" if hit.status == 429 else "invalid_request_error"
    body = json.dumps({"error": {"message": f"hpcserve endpoint: {hit.message}", "type": kind, "param": hit.limit,
                                 "code": "rate_limit_exceeded" if hit.status == 429 else "limit_exceeded"}}).encode()
    headers = {"Retry-After": str(hit.retry_after_s)} if hit.retry_after_s is not None else None
    return hit.status, body, headers


def model_refusal(model: str | None, allowed: tuple[str, ...], named: bool = True) -> bytes:
    """403 for a key of some models. A request that names no model asks for the endpoint's own."""
    if named:
        asked = f"the model {model!r}"
    else:
        asked = f"this endpoint's model{f' {model!r}' if model else ''} (the request names none)"
    return wire.error_body(f"hpcserve endpoint: this key may not use {asked}; it may use "
                           f"{', '.join(allowed) or 'none'}: name one in the request's \"model\"",
                           "permission_denied", "model_not_allowed")
