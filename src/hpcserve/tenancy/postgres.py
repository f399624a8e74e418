"""Tenancy's records in a PostgreSQL database: for an endpoint whose data planes run on several hosts.

The same tables as the SQLite file (tables.py). Every process that opens the store makes the tables when
they are missing, so two that start at once (two data-plane hosts) take a transaction-level advisory lock
first: CREATE TABLE IF NOT EXISTS alone can fail in the second one on a unique violation of the catalog.

The URL carries no password (the config refuses one; libpq reads ~/.pgpass or PGPASSFILE), and is never
logged nor kept where a repr or a traceback would show it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hpcserve.tenancy import tables
from hpcserve.tenancy.records import GroupBy, KeyRecord, UsageRow, UsageTotal, WindowCounts

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10
# pg_advisory_xact_lock's key for making the tables: any constant; one that no other program is likely to use.
SCHEMA_LOCK = 0x68706373_74656E61  # "hpcstena"

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS keys (
        key_id TEXT PRIMARY KEY,
        user_name TEXT NOT NULL,
        salt BYTEA NOT NULL,
        digest BYTEA NOT NULL,
        project TEXT,
        models TEXT,
        limits TEXT NOT NULL,
        source TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION,
        revoked_at DOUBLE PRECISION
    )""",
    """CREATE TABLE IF NOT EXISTS usage (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        started_at DOUBLE PRECISION NOT NULL,
        key_id TEXT NOT NULL,
        user_name TEXT NOT NULL,
        project TEXT,
        model TEXT,
        route TEXT NOT NULL,
        status INTEGER NOT NULL,
        prompt_tokens BIGINT,
        cached_tokens BIGINT,
        completion_tokens BIGINT,
        ttft_s DOUBLE PRECISION,
        duration_s DOUBLE PRECISION NOT NULL,
        migrated BOOLEAN NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS usage_started_at ON usage (started_at)",
    """CREATE TABLE IF NOT EXISTS usage_minute (
        key_id TEXT NOT NULL,
        minute BIGINT NOT NULL,
        requests BIGINT NOT NULL,
        tokens BIGINT NOT NULL,
        PRIMARY KEY (key_id, minute)
    )""",
    "CREATE INDEX IF NOT EXISTS usage_minute_minute ON usage_minute (minute)",
    """CREATE TABLE IF NOT EXISTS meta (
        name TEXT PRIMARY KEY,
        value BIGINT NOT NULL
    )""",
    "INSERT INTO meta (name, value) VALUES ('revision', 0) ON CONFLICT (name) DO NOTHING",
]

# The UTC date of started_at; the other groups are columns (tables.GROUP_COLUMNS).
DAY_SQL = "to_char(to_timestamp(started_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


class PostgresStore:
    """store.Store in a PostgreSQL database (its tables made when missing). One connection, opened again on the
    next call after it broke (a server restart): the call that found it broken fails, the next ones work."""

    def __init__(self, url: str):
        self.__url = url  # name-mangled, and never in a message: a URL may name more than we want shown
        self._db = self._connect()
        try:
            with self._db.transaction():
                self._db.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
                for statement in SCHEMA:
                    self._db.execute(statement)
        except BaseException:
            self._db.close()
            raise

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"

    def _connect(self) -> psycopg.Connection:
        import psycopg  # only a service that names a PostgreSQL server needs the driver (SQLite is the default)

        # autocommit: a read is its own statement; every write is in an explicit transaction (conn.transaction())
        return psycopg.connect(self.__url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                               application_name="hpcserve")

    def _conn(self) -> psycopg.Connection:
        if self._db.broken:
            log.warning("the connection to the tenancy database broke; connecting again")
            self._db.close()
            self._db = self._connect()
        return self._db

    def add_key(self, record: KeyRecord) -> None:
        db = self._conn()
        with db.transaction():
            db.execute(f"INSERT INTO keys ({', '.join(tables.KEY_COLUMNS)}) "
                       f"VALUES ({', '.join(['%s'] * len(tables.KEY_COLUMNS))})", tables.key_row(record))
            db.execute("UPDATE meta SET value = value + 1 WHERE name = %s", (tables.REVISION,))

    def revoke(self, key_id: str, now: float) -> bool:
        db = self._conn()
        with db.transaction():
            done = db.execute("UPDATE keys SET revoked_at = %s WHERE key_id = %s AND revoked_at IS NULL",
                              (now, key_id))
            if done.rowcount != 1:
                return False
            db.execute("UPDATE meta SET value = value + 1 WHERE name = %s", (tables.REVISION,))
            return True

    def keys(self) -> list[KeyRecord]:
        rows = self._conn().execute(f"SELECT {', '.join(tables.KEY_COLUMNS)} FROM keys ORDER BY created_at, key_id")
        return [tables.key_record(row) for row in rows]

    def revision(self) -> int:
        return tables.revision_value(
            self._conn().execute("SELECT value FROM meta WHERE name = %s", (tables.REVISION,)).fetchone())

    def record_usage(self, rows: Sequence[UsageRow]) -> list[tuple[str, int, int, int]]:
        if not rows:
            return []
        counts = tables.minute_counts(rows)
        db = self._conn()
        with db.transaction(), db.cursor() as cursor:
            cursor.executemany(f"INSERT INTO usage ({', '.join(tables.USAGE_COLUMNS)}) "
                               f"VALUES ({', '.join(['%s'] * len(tables.USAGE_COLUMNS))})",
                               [tables.usage_row(row) for row in rows])
            cursor.executemany(tables.MINUTE_UPSERT, counts)
        return counts

    def usage(self, by: GroupBy, since: float | None = None, until: float | None = None) -> list[UsageTotal]:
        group = DAY_SQL if by is GroupBy.DAY else tables.GROUP_COLUMNS[by]
        where, params = tables.time_filter("started_at", since, until, "%s")
        db = self._conn()
        totals = db.execute(f"SELECT {group}, {tables.TOTALS_SQL} FROM usage{where} GROUP BY 1", params).fetchall()
        # percentile_cont leaves out NULLs; a group whose rows have no TTFT gets NULL.
        medians = db.execute(f"SELECT {group}, percentile_cont(0.5) WITHIN GROUP (ORDER BY ttft_s) FROM usage{where} "
                             "GROUP BY 1", params).fetchall()
        return tables.totals(totals, {grp: median for grp, median in medians if median is not None})

    def rows(self, since: float | None = None) -> list[UsageRow]:
        where, params = tables.time_filter("started_at", since, None, "%s")
        rows = self._conn().execute(f"SELECT {', '.join(tables.USAGE_COLUMNS)} FROM usage{where} "
                                    "ORDER BY started_at, id", params)
        return [tables.usage_record(row) for row in rows]

    def window_counts(self, since_minute: int) -> dict[str, dict[int, WindowCounts]]:
        counts: dict[str, dict[int, WindowCounts]] = {}
        rows = self._conn().execute("SELECT key_id, minute, requests, tokens FROM usage_minute WHERE minute >= %s",
                                    (since_minute,))
        for key_id, minute, requests, tokens in rows:
            counts.setdefault(key_id, {})[int(minute)] = WindowCounts(int(requests), int(tokens))
        return counts

    def close(self) -> None:
        self._db.close()
