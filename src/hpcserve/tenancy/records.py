"""What tenancy keeps: keys (as salted hashes), their limits, and one usage row per request. Pure data and
pure functions; the stores (store.py) keep them, the data plane reads them through an in-memory view.

A key is `hps_<key id>_<secret>`: the id (public, 16 hex digits) finds the record, the secret (32 random
bytes, URL-safe base64) is checked against sha256(salt + secret) in constant time. Only the id, the salt
and the digest are stored; the whole key is printed once, when it is made.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import NamedTuple

KEY_PREFIX = "hps"
KEY_ID_BYTES = 8
SALT_BYTES = 16


class KeySource(str, Enum):
    ADMIN = "admin"  # `hpcserve keys add` by the deployment's owner
    SELF_SERVICE = "self-service"  # a cluster user's own, identified by the operating system

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Limits:
    """What one key may use; None: no limit. Rates are per minute (sliding), tokens_per_day per UTC day."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    max_n: int | None = None  # the request's n (choices)
    max_best_of: int | None = None
    max_tokens: int | None = None  # max_tokens / max_completion_tokens of one request

    def merged(self, override: Limits) -> Limits:
        """These limits with override's where override sets one."""
        return replace(self, **{k: v for k, v in override.__dict__.items() if v is not None})


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    user: str
    salt: bytes
    digest: bytes
    project: str | None = None
    models: tuple[str, ...] | None = None  # None: every model of the endpoint
    limits: Limits = field(default_factory=Limits)
    source: KeySource = KeySource.ADMIN
    created_at: float = 0.0  # epoch seconds
    expires_at: float | None = None
    revoked_at: float | None = None

    def usable(self, now: float) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)

    def allows_model(self, model: str | None) -> bool:
        return self.models is None or model in self.models


class UsageRow(NamedTuple):
    """One request as it ended. A tuple in the usage table's column order (tables.USAGE_COLUMNS): one is made per
    request on the data plane's hot path, where a tuple is the cheapest record to make and to bind to an INSERT,
    and a tuple of plain values leaves the garbage collector's lists at its first collection, while the rows wait
    for their write."""

    started_at: float  # epoch seconds
    key_id: str  # "owner" for the deployment's own key
    user: str
    project: str | None
    model: str | None
    route: str  # the request's path, e.g. /v1/chat/completions
    status: int  # the HTTP status the client got (499: it left first)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None  # time to the first byte sent to the client
    duration_s: float = 0.0
    migrated: bool = False  # a stream that continued on another replica


class GroupBy(str, Enum):
    USER = "user"
    PROJECT = "project"
    MODEL = "model"
    DAY = "day"  # UTC

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class UsageTotal:
    """One line of `hpcserve usage`: the rows of one user / project / model / day."""

    group: str  # the user, project, model or day (YYYY-MM-DD); "-" where the rows have none
    requests: int
    failed: int  # status >= 400, clients that left (499) included
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    migrated: int
    ttft_p50_s: float | None  # of the rows that have one
    duration_s: float  # summed


@dataclass(frozen=True)
class WindowCounts:
    """What one key used in a window, from usage_minute."""

    requests: int
    tokens: int  # prompt + completion


OWNER_KEY_ID = "owner"


def new_key(user: str, *, project: str | None = None, models: tuple[str, ...] | None = None,
            limits: Limits = Limits(), source: KeySource = KeySource.ADMIN, expires_at: float | None = None,
            now: float | None = None) -> tuple[str, KeyRecord]:
    """A new key: the whole key (shown once) and the record that keeps only its hash."""
    key_id = secrets.token_hex(KEY_ID_BYTES)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_bytes(SALT_BYTES)
    record = KeyRecord(key_id, user, salt, secret_digest(salt, secret.encode()), project, models, limits, source,
                       time.time() if now is None else now, expires_at)
    return f"{KEY_PREFIX}_{key_id}_{secret}", record


def secret_digest(salt: bytes, secret: bytes) -> bytes:
    return hashlib.sha256(salt + secret).digest()


def split_key(token: bytes) -> tuple[str, bytes] | None:
    """(key id, secret) of a token shaped like one of our keys, else None. Pure."""
    prefix, sep, rest = token.partition(b"_")
    if prefix != KEY_PREFIX.encode() or not sep:
        return None
    key_id, sep, secret = rest.partition(b"_")
    if not sep or len(key_id) != 2 * KEY_ID_BYTES or not secret:
        return None
    try:
        return key_id.decode("ascii"), secret
    except UnicodeDecodeError:
        return None


_DUMMY = KeyRecord("0" * 16, "", b"\0" * SALT_BYTES, b"\0" * 32)


def matches(record: KeyRecord | None, secret: bytes) -> bool:
    """Whether secret is record's, in the same time whether or not the record exists (an unknown id is
    checked against a dummy), so that a guess learns nothing from how long its refusal took."""
    candidate = record or _DUMMY
    ok = hmac.compare_digest(secret_digest(candidate.salt, secret), candidate.digest)
    return ok and record is not None
