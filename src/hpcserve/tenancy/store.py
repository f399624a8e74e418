"""The one interface to where tenancy's records live: an embedded SQLite file (the default) or a PostgreSQL
server (a service on several hosts), chosen by URL (`open_store`). Every method is blocking and safe to call
from one thread at a time per store object; the data plane calls it off its event loop (view.py, usage.py).

Tables (the same in both):
- keys: one row per key (records.KeyRecord; limits and models as JSON text), never deleted: a revoked key
  keeps its row, with revoked_at set.
- usage: one row per request (records.UsageRow).
- usage_minute: per key and minute (epoch minute), the requests and tokens of its usage rows: what limits
  read (a day is at most 1,440 rows per key, however many requests).
- meta: revision, raised by every change to keys: the data plane's view reloads when it moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from hpcserve.tenancy.postgres import PostgresStore
from hpcserve.tenancy.records import GroupBy, KeyRecord, UsageRow, UsageTotal, WindowCounts
from hpcserve.tenancy.sqlite import SqliteStore

__all__ = ["GroupBy", "Store", "UsageTotal", "WindowCounts", "open_store"]


class Store(Protocol):
    def add_key(self, record: KeyRecord) -> None: ...

    def revoke(self, key_id: str, now: float) -> bool:
        """False: no such key, or already revoked."""
        ...

    def keys(self) -> list[KeyRecord]:
        """Every key, revoked and expired ones too, oldest first."""
        ...

    def revision(self) -> int:
        """Raised by every add_key and revoke: cheap, polled."""
        ...

    def record_usage(self, rows: Sequence[UsageRow]) -> list[tuple[str, int, int, int]]:
        """Rows and their minutes' counts, in one transaction; returns those counts (tables.minute_counts)."""
        ...

    def usage(self, by: GroupBy, since: float | None = None, until: float | None = None) -> list[UsageTotal]: ...

    def rows(self, since: float | None = None) -> list[UsageRow]:
        """Usage rows, oldest first (tests, --csv of single requests)."""
        ...

    def window_counts(self, since_minute: int) -> dict[str, dict[int, WindowCounts]]:
        """Per key id, per epoch minute >= since_minute: requests and tokens (limits' view)."""
        ...

    def close(self) -> None: ...


def open_store(url: str | Path) -> Store:
    """A store by URL: postgresql://... (or postgres://) for PostgreSQL, sqlite:///PATH or a plain path for an
    SQLite file (made, mode 0600, with its tables, when missing)."""
    text = str(url)
    if text.startswith(("postgresql://", "postgres://")):
        return PostgresStore(text)
    return SqliteStore(Path(text.removeprefix("sqlite://")))
