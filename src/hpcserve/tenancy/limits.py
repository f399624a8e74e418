"""Whether one request is within its key's limits: caps on what one request asks for (n, best_of,
max_tokens), and rates (requests and tokens per minute, tokens per UTC day). Pure: the counts come from
the caller (view.Meter), the clock too.

Rates use a sliding minute, estimated as Cloudflare's and nginx's limiters do: the previous minute's count
weighted by the part of it still inside the last 60 s, plus the current minute's. A day is a UTC day.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeGuard

from hpcserve.tenancy.records import Limits

DAY_S = 86_400


@dataclass(frozen=True)
class LimitHit:
    """A refusal: status 400 for a request no retry can make acceptable (a cap), 429 for a rate with the
    seconds until the window has room (Retry-After)."""

    status: int
    limit: str  # the limit's name as in the config, e.g. requests_per_minute
    message: str
    retry_after_s: int | None = None


class Window:
    """One key's counts: the previous and the current minute, and the UTC day so far. Mutable: the caller keeps
    one per key as running sums (view.Meter), moved on as requests start and end, rather than one made per
    request."""

    __slots__ = ("day_tokens", "previous_requests", "previous_tokens", "requests", "tokens")

    def __init__(self, previous_requests: int = 0, previous_tokens: int = 0, requests: int = 0, tokens: int = 0,
                 day_tokens: int = 0):
        self.previous_requests, self.previous_tokens = previous_requests, previous_tokens
        self.requests, self.tokens, self.day_tokens = requests, tokens, day_tokens

    def __repr__(self) -> str:
        return (f"Window(previous_requests={self.previous_requests}, previous_tokens={self.previous_tokens}, "
                f"requests={self.requests}, tokens={self.tokens}, day_tokens={self.day_tokens})")


def cap_hit(limits: Limits, data: dict | None) -> LimitHit | None:
    """A cap the request's JSON passes (its n, best_of or max_tokens), else None."""
    if data is None:
        return None
    for field, limit, name in (("n", limits.max_n, "max_n"), ("best_of", limits.max_best_of, "max_best_of")):
        value = data.get(field)
        if limit is not None and _number(value) and value > limit:
            return LimitHit(400, name, f"{field} is {value}, above this key's limit {name} = {limit}: ask for at "
                                       f"most {limit}")
    if limits.max_tokens is not None:
        for field in ("max_tokens", "max_completion_tokens"):
            value = data.get(field)
            if _number(value) and value > limits.max_tokens:
                return LimitHit(400, "max_tokens", f"{field} is {value}, above this key's limit max_tokens = "
                                                   f"{limits.max_tokens}: ask for at most {limits.max_tokens}")
    return None


def missing_max_tokens(limits: Limits, data: dict | None) -> int | None:
    """The max_tokens to send with a request that sets none while its key has a max_tokens cap (an engine
    would otherwise generate up to the context's end), else None."""
    if limits.max_tokens is None or data is None:
        return None
    if data.get("max_tokens") is None and data.get("max_completion_tokens") is None:
        return limits.max_tokens
    return None


def rate_hit(limits: Limits, window: Window, now: float) -> LimitHit | None:
    """A rate this request would pass (counted as one more request), else None."""
    # The previous minute's weight is at most 1 (and the counts >= 0): a window whose two minutes' plain sum is
    # within a rate is within its sliding count too, and most requests need no weighing at all.
    rpm = limits.requests_per_minute
    if rpm is not None and window.previous_requests + window.requests + 1 > rpm:
        into = (now % 60) / 60  # the part of the current minute gone; 1 - into: the previous minute's weight
        if window.previous_requests * (1 - into) + window.requests + 1 > rpm:
            wait = _until_below(window.previous_requests, window.requests, into, rpm - 1)
            return _rate(rpm, "requests_per_minute", "requests in the last minute", wait)
    tpm = limits.tokens_per_minute
    if tpm is not None and window.previous_tokens + window.tokens >= tpm:
        into = (now % 60) / 60
        if window.previous_tokens * (1 - into) + window.tokens >= tpm:
            wait = _until_below(window.previous_tokens, window.tokens, into, tpm - 1)
            return _rate(tpm, "tokens_per_minute", "tokens in the last minute", wait)
    if limits.tokens_per_day is not None and window.day_tokens >= limits.tokens_per_day:
        wait = DAY_S - now % DAY_S
        return _rate(limits.tokens_per_day, "tokens_per_day", "tokens today (UTC)", wait, "at 00:00 UTC, ")
    return None


def _rate(limit: int, name: str, what: str, wait_s: float, when: str = "") -> LimitHit:
    seconds = max(1, math.ceil(wait_s))
    return LimitHit(429, name, f"rate limit {name} = {limit} reached ({what}): it resets {when}in {seconds} s",
                    seconds)


def _until_below(previous: int, current: int, into: float, most: float) -> float:
    """Seconds until the sliding count is at most `most`: within this minute as the previous one's weight
    fades, else into the next minute, where the current count becomes the previous."""
    if current <= most and previous > 0:
        needed = 1 - (most - current) / previous  # the part of the minute gone at which it fits
        if needed <= 1:
            return max(0.0, needed - into) * 60
    rest = (1 - into) * 60
    if current <= 0:
        return rest
    needed = max(0.0, 1 - max(most, 0) / current)  # in the next minute, the count now is the previous
    return rest + needed * 60


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
