"""What the owner does with keys (`hpcserve keys ...`), over a store: add one (the whole key returned once),
list them, revoke by key id or by user. And the times people write on a command line (30d, 12h,
2027-01-31), read as epoch seconds."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

from hpcserve.core.errors import UsageError
from hpcserve.tenancy.records import KeyRecord, KeySource, Limits, new_key
from hpcserve.tenancy.store import Store

DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}$")  # a user's or a project's


def add_key(store: Store, user: str, *, project: str | None = None, models: tuple[str, ...] | None = None,
            limits: Limits = Limits(), expires_at: float | None = None,
            source: KeySource = KeySource.ADMIN) -> tuple[str, KeyRecord]:
    """A new key for user, stored as its hash; the whole key is returned here and nowhere else."""
    if not NAME.match(user):
        raise UsageError(f"user name {user!r}: use letters, digits and _.@- (at most 64), as a Unix or e-mail name")
    if project is not None and not NAME.match(project):
        raise UsageError(f"project {project!r}: use letters, digits and _.@- (at most 64), as a Slurm account "
                         "or a grant's name; leave --project out for none")
    if models is not None and not all(model.strip() for model in models):
        raise UsageError("--model '': give a model's served name (`hpcserve status` shows it), or leave --model "
                         "out for every model")
    if expires_at is not None and expires_at <= time.time():
        raise UsageError("--expires is in the past: give a duration (30d, 12h) or a date after today")
    key, record = new_key(user, project=project, models=models, limits=limits, source=source, expires_at=expires_at)
    store.add_key(record)
    return key, record


def revoke(store: Store, selector: str, now: float | None = None) -> list[KeyRecord]:
    """Revoke the key with this id, or every live key of the user of this name; the keys revoked."""
    now = time.time() if now is None else now
    live = [r for r in store.keys()  # noqa: SIM118 - a Store, not a dict
            if r.revoked_at is None and selector in (r.key_id, r.user)]
    if not live:
        raise UsageError(f"no live key has the id or user {selector!r}: `hpcserve keys list` shows them")
    return [r for r in live if store.revoke(r.key_id, now)]


def parse_when(text: str, now: float | None = None, *, past: bool = False) -> float:
    """A duration from now (30d, 12h, 90m, 2w; into the past with past=True) or a date / time (ISO 8601,
    UTC unless it says otherwise) as epoch seconds. UsageError naming the forms otherwise."""
    now = time.time() if now is None else now
    match = DURATION.match(text.strip().lower())
    if match:
        seconds = float(match.group(1)) * UNIT_S[match.group(2)]
        return now - seconds if past else now + seconds
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(f"{text!r} is neither a duration (30d, 12h, 90m, 2w) nor a date (2027-01-31, "
                         "2027-01-31T12:00)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()
