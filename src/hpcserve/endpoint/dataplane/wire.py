"""What the data plane says and decides on the wire, apart from choosing a backend (routing/): its own
error answers (OpenAI-style JSON), which headers pass, what the prefix policy routes on, and when a
failed attempt is tried again or a request held. No I/O, no event loop. (The key check is core.keys.KeyCheck,
shared with the engines' guard and the monitor.)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from hpcserve.endpoint.dataplane.routing.prefix_index import prompt_blocks, prompt_text, request_json
from hpcserve.endpoint.dataplane.routing.table import Affinity

RETRY_AFTER_S = 5  # what a 503 tells clients to wait: about one controller round plus a join
KEY_HEADERS = ("x-session-id", "x-user-id")  # what vLLM-router's consistent_hash reads, in this order

# Hop-by-hop headers (RFC 9110 7.6.1) are about one connection, not the request; Host and Content-Length
# are set again for the next hop; Expect is answered here (100 Continue), not passed on.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                        "te", "trailer", "transfer-encoding", "upgrade"})
NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect"}
NOT_FORWARDED_WITH_OWN_KEY = NOT_FORWARDED | {"authorization"}  # the data plane sends the engines its own key
NOT_RETURNED = HOP_BY_HOP | {"content-length", "date", "server"}


# ------------------------------------------------------------------ errors the data plane answers itself

def error_body(message: str, kind: str, code: str) -> bytes:
    """OpenAI's error shape: clients' SDKs read error.message and show it."""
    return json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()


# vLLM's development routes (VLLM_SERVER_DEV_MODE=1, which engine.sleep_mode turns on for /sleep and /wake_up):
# the controller's to call on an engine, never a client's through the endpoint (with tenants the data plane
# sends the engines' own key). vllm 0.32's entrypoints/serve/dev/.
ENGINE_ONLY = frozenset({"/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/reset_prefix_cache",
                         "/reset_mm_cache", "/reset_encoder_cache", "/release_kv_cache_memory", "/server_info"})


def engine_only(target: str) -> bool:
    """Whether a request target is one of vLLM's development routes (not forwarded). Pure."""
    return target.split("?", 1)[0].rstrip("/") in ENGINE_ONLY


def not_forwarded(target: str) -> bytes:
    return error_body(f"hpcserve endpoint: {target.split('?', 1)[0][:100]} is an engine's development route, not "
                      "served to clients", "invalid_request_error", "not_found")


UNAUTHORIZED = error_body(
    "Missing or wrong API key for this hpcserve endpoint: send the header 'Authorization: Bearer KEY'. The key "
    "is in the file api_key of the deployment's run folder when hpcserve generated it, or in the environment "
    "variable that serve.api_key_env names; `hpcserve status NAME` shows which.",
    "invalid_request_error", "invalid_api_key")


def no_backend(hold_s: float) -> bytes:
    waited = f"waited {hold_s:g} s, but " if hold_s > 0 else ""
    return error_body(f"hpcserve endpoint: {waited}no model replica can take requests right now (none is in the "
                      f"pool, as while one starts or is replaced, or none accepts connections). Retry after "
                      f"{RETRY_AFTER_S} s.",
                      "service_unavailable", "no_replica")


def too_large(limit_bytes: int) -> bytes:
    return error_body(f"hpcserve endpoint: the request body is larger than {limit_bytes // 2**20} MiB, the "
                      "endpoint's limit.", "invalid_request_error", "request_too_large")


def bad_request(reason: str) -> bytes:
    return error_body(f"hpcserve endpoint: malformed HTTP request: {reason}", "invalid_request_error", "bad_request")


def invalid_body(reason: str) -> bytes:
    """A body the data plane refuses itself: only what vLLM would answer with a 500 or outside OpenAI's
    error shape (the rest is vLLM's to judge, its 4xx passed on)."""
    return error_body(f"hpcserve endpoint: {reason}", "invalid_request_error", "invalid_request_body")


def json_content(content_type: str | None) -> bool:
    """Whether vLLM's server (FastAPI) reads a body of this Content-Type as JSON: none, application/json,
    application/*+json."""
    if not content_type:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or kind.startswith("application/") and kind.endswith("+json")


def body_timeout(timeout_s: float) -> bytes:
    return error_body(f"hpcserve endpoint: the request body did not arrive within {timeout_s:g} s.",
                      "invalid_request_error", "request_timeout")


def bad_gateway(detail: str) -> bytes:
    return error_body(f"hpcserve endpoint: the model replica could not be reached ({detail}).",
                      "service_unavailable", "replica_unreachable")


def replica_timeout(timeout_s: float) -> bytes:
    return error_body(f"hpcserve endpoint: the model replica sent nothing for {timeout_s:g} s.",
                      "service_unavailable", "replica_timeout")


def too_many_connections(limit: int) -> bytes:
    """A whole HTTP response, written before the connection is closed: the request is never read."""
    body = error_body(f"hpcserve endpoint: more than {limit} connections are open; retry shortly.",
                      "service_unavailable", "too_many_connections")
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: {RETRY_AFTER_S}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


# ------------------------------------------------------------------ headers

def forwarded_headers(headers: Iterable[tuple[str, str]], authorization: dict[str, str] | None = None
                      ) -> dict[str, str]:
    """The client's headers the engine gets: all but hop-by-hop ones (the key included: the engines
    check the same key). Repeated headers are joined, as RFC 9110 allows for list-valued fields.
    authorization: the engines' own Authorization header, sent in place of the client's (any case) where a
    user's key must stay here (tenants); replaced in the same pass, not in a second copy of the headers."""
    dropped = NOT_FORWARDED if authorization is None else NOT_FORWARDED_WITH_OWN_KEY
    out: dict[str, str] = {}
    for name, value in headers:
        lower = name.lower()
        if lower in dropped:
            continue
        out[name] = f"{out[name]}, {value}" if name in out else value
    if authorization:
        out.update(authorization)
    return out


def returned_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The engine's response headers the client gets (status, content type, x-request-id, ...)."""
    return [(name, value) for name, value in headers if name.lower() not in NOT_RETURNED]


# ------------------------------------------------------------------ affinity (the prefix policy)

def request_affinity(headers: Mapping[str, str], body: bytes | dict | None, tokenizer=None) -> Affinity:
    """What the prefix policy routes on: X-Session-ID or X-User-ID when the client names one, the parsed
    prompt's blocks (prefix_index.prompt_blocks; the blocks are recorded either way, so that a session's
    replica is known to hold its conversation), and its token ids when a tokenizer is given
    (prompt_tokens.PromptTokenizer: while some engine's KV events are followed). body: as bytes or parsed."""
    session = None
    for name in KEY_HEADERS:
        value = headers.get(name)
        if value:
            session = value.encode("utf-8", "surrogateescape")
            break
    data = body if isinstance(body, dict) or body is None else request_json(body)
    tokens = tokenizer.tokens(data) if tokenizer is not None and data is not None else None
    return Affinity(session, prompt_blocks(prompt_text(data)), tokens)


# ------------------------------------------------------------------ retries and holds

class Failure(Enum):
    """How an attempt to reach a backend failed before any response byte went to the client."""

    CONNECT = "connect"  # refused, unreachable, connect timeout: the request never reached an engine
    DISCONNECT = "disconnect"  # the connection closed or reset after the request was sent: the engine
    #                            may have received it (it died under it, or the request killed it), or
    #                            it was a pooled keep-alive connection the engine had just closed
    TIMEOUT = "timeout"  # the engine accepted the request but sent nothing for first_byte_timeout_s


@dataclass(frozen=True)
class Attempt:
    """What to do after a failed attempt."""

    retry: bool  # send the request to a backend again
    mark_failed: bool  # skip this backend for FAILED_S


def after_failure(failure: Failure, tries: int, max_tries: int, resent: int, max_resends: int = 1) -> Attempt:
    """Before any response byte reached the client. A request that never reached an engine (a refused
    connection) is tried again, bounded by max_tries, and that backend is skipped for a while. One that
    may have reached an engine (a dropped connection) is sent again only max_resends times: once lets a
    replica killed under a request cost no request, while a request that itself kills engines reaches
    two of them, not every one; a dropped connection alone does not mark the backend (an engine closing
    an idle keep-alive connection is no failure). An engine that accepted the request and then said
    nothing for the first-byte timeout is not tried again: it may still be working on it, and the client
    has waited that long already. Once a response began, nothing is retried (this is not asked then)."""
    if failure is Failure.TIMEOUT:
        return Attempt(retry=False, mark_failed=False)
    if failure is Failure.DISCONNECT:
        return Attempt(retry=tries < max_tries and resent < max_resends, mark_failed=False)
    return Attempt(retry=tries < max_tries, mark_failed=True)


def hold_wait(now: float, deadline: float, recovery: float | None) -> float | None:
    """While no backend is eligible: how long to wait for a change (a backend added, or a failed one's
    pause over) before choosing again; None once the hold's deadline has passed (answer 503)."""
    if now >= deadline:
        return None
    return min(deadline, recovery) - now if recovery is not None and recovery > now else deadline - now
