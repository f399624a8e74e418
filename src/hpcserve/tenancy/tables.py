"""The table layout both stores share (store.py names the tables): the columns, and records turned into rows
and back, so that an SQLite file and a PostgreSQL database hold the same values in the same columns.

The column of a record's `user` is `user_name`: `user` alone is a reserved word in PostgreSQL (unquoted, it
reads the connected role's name, silently).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, fields
from typing import Any

from hpcserve.tenancy.records import GroupBy, KeyRecord, KeySource, Limits, UsageRow, UsageTotal

KEY_COLUMNS = ("key_id", "user_name", "salt", "digest", "project", "models", "limits", "source", "created_at",
               "expires_at", "revoked_at")
USAGE_COLUMNS = ("started_at", "key_id", "user_name", "project", "model", "route", "status", "prompt_tokens",
                 "cached_tokens", "completion_tokens", "ttft_s", "duration_s", "migrated")
REVISION = "revision"  # meta's one row
NO_GROUP = "-"

# The column a GroupBy groups on; DAY's expression is each database's own (the UTC date of started_at).
GROUP_COLUMNS = {GroupBy.USER: "user_name", GroupBy.PROJECT: "project", GroupBy.MODEL: "model"}

# The totals of usage(), after the group: the same aggregates in both databases (integer sums cast so that
# PostgreSQL gives integers, not numerics).
TOTALS_SQL = ("COUNT(*), SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END), "
              "CAST(COALESCE(SUM(prompt_tokens), 0) AS BIGINT), CAST(COALESCE(SUM(cached_tokens), 0) AS BIGINT), "
              "CAST(COALESCE(SUM(completion_tokens), 0) AS BIGINT), SUM(CASE WHEN migrated THEN 1 ELSE 0 END), "
              "COALESCE(SUM(duration_s), 0)")

# Adds a (key id, minute, requests, tokens) to its minute's counts; %s placeholders (PostgreSQL's; SQLite's ?).
MINUTE_UPSERT = ("INSERT INTO usage_minute (key_id, minute, requests, tokens) VALUES (%s, %s, %s, %s) "
                 "ON CONFLICT (key_id, minute) DO UPDATE SET requests = usage_minute.requests + excluded.requests, "
                 "tokens = usage_minute.tokens + excluded.tokens")

_LIMIT_NAMES = {f.name for f in fields(Limits)}


def key_row(record: KeyRecord) -> tuple[Any, ...]:
    models = None if record.models is None else json.dumps(list(record.models))
    return (record.key_id, record.user, bytes(record.salt), bytes(record.digest), record.project, models,
            json.dumps(asdict(record.limits), sort_keys=True), record.source.value, record.created_at,
            record.expires_at, record.revoked_at)


def key_record(row: Sequence[Any]) -> KeyRecord:
    """The record of a keys row (columns in KEY_COLUMNS' order). A limit this version does not know (written
    by a newer one) is left out rather than refused: the key keeps working with the limits it knows."""
    key_id, user, salt, digest, project, models, limits, source, created_at, expires_at, revoked_at = row
    known = {k: v for k, v in json.loads(limits).items() if k in _LIMIT_NAMES}
    return KeyRecord(key_id, user, bytes(salt), bytes(digest), project,
                     None if models is None else tuple(json.loads(models)), Limits(**known), KeySource(source),
                     created_at, expires_at, revoked_at)


def revision_value(row: Sequence[Any] | None) -> int:
    """meta's revision from its row; the row is made with the tables, so none means a damaged database."""
    if row is None:
        raise RuntimeError("the tenancy database has no revision in its meta table")
    return int(row[0])


def usage_row(row: UsageRow) -> tuple[Any, ...]:
    """The row's values in USAGE_COLUMNS' order: a UsageRow is that tuple already (migrated made a bool, for
    PostgreSQL's boolean column, where a caller gave another truth value)."""
    return row if type(row.migrated) is bool else row._replace(migrated=bool(row.migrated))


def usage_record(row: Sequence[Any]) -> UsageRow:
    values = list(row)
    values[-1] = bool(values[-1])  # SQLite keeps booleans as 0 / 1
    return UsageRow(*values)


def minute_counts(rows: Iterable[UsageRow]) -> list[tuple[str, int, int, int]]:
    """(key id, epoch minute, requests, tokens) of these rows, summed per key and minute, in one order (key,
    minute): two writers that upsert the same minutes lock them in the same order, so neither waits on the other
    in a cycle (PostgreSQL would abort one as a deadlock)."""
    counts: dict[tuple[str, int], list[int]] = {}
    for row in rows:
        count = counts.setdefault((row.key_id, int(row.started_at // 60)), [0, 0])
        count[0] += 1
        count[1] += (row.prompt_tokens or 0) + (row.completion_tokens or 0)
    return [(key_id, minute, requests, tokens) for (key_id, minute), (requests, tokens) in sorted(counts.items())]


def totals(rows: Iterable[Sequence[Any]], medians: dict[Any, float]) -> list[UsageTotal]:
    """UsageTotals of (group, *TOTALS_SQL's columns) rows and each group's median TTFT, in group order."""
    out = [UsageTotal(NO_GROUP if group is None else str(group), int(requests), int(failed), int(prompt),
                      int(cached), int(completion), int(migrated), medians.get(group), float(duration))
           for group, requests, failed, prompt, cached, completion, migrated, duration in rows]
    return sorted(out, key=lambda total: total.group)


def time_filter(column: str, since: float | None, until: float | None, placeholder: str) -> tuple[str, list[float]]:
    """A WHERE clause (empty: no bound) for since <= column < until, and its parameters."""
    clauses, params = [], []
    if since is not None:
        clauses.append(f"{column} >= {placeholder}")
        params.append(since)
    if until is not None:
        clauses.append(f"{column} < {placeholder}")
        params.append(until)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params
