"""Tenancy's records in one SQLite file: the default, for an endpoint on one host.

Several processes write it at once (the data plane's workers record usage, the CLI adds and revokes keys):
WAL lets readers go on while one writes, every write transaction takes the write lock when it begins
(BEGIN IMMEDIATE: a transaction that reads first and upgrades later could fail at once, busy, where one
that waits at its start queues behind the writer), and the busy timeout is how long it queues.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hpcserve.tenancy import tables
from hpcserve.tenancy.records import GroupBy, KeyRecord, UsageRow, UsageTotal, WindowCounts

# Usage rows per INSERT statement. SQLite runs a statement with the GIL released and Python binds the next one
# with it held: a data-plane worker's event loop and its writing thread trade the GIL once per statement,
# and once per row with executemany (measured: the worker's CPU per request 1.2x the same plane without
# tenancy, 1.1x with the rows unwritten).
ROWS_PER_INSERT = 256
BUSY_TIMEOUT_S = 30.0  # a writer waits this long for another's transaction (they last milliseconds)
FILE_MODE = 0o600  # key hashes and who used what: the owner's alone
FOLDER_MODE = 0o700

SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    key_id TEXT PRIMARY KEY,
    user_name TEXT NOT NULL,
    salt BLOB NOT NULL,
    digest BLOB NOT NULL,
    project TEXT,
    models TEXT,
    limits TEXT NOT NULL,
    source TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    revoked_at REAL
);
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY,
    started_at REAL NOT NULL,
    key_id TEXT NOT NULL,
    user_name TEXT NOT NULL,
    project TEXT,
    model TEXT,
    route TEXT NOT NULL,
    status INTEGER NOT NULL,
    prompt_tokens INTEGER,
    cached_tokens INTEGER,
    completion_tokens INTEGER,
    ttft_s REAL,
    duration_s REAL NOT NULL,
    migrated INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_started_at ON usage (started_at);
CREATE TABLE IF NOT EXISTS usage_minute (
    key_id TEXT NOT NULL,
    minute INTEGER NOT NULL,
    requests INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    PRIMARY KEY (key_id, minute)
);
CREATE INDEX IF NOT EXISTS usage_minute_minute ON usage_minute (minute);
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT OR IGNORE INTO meta (name, value) VALUES ('revision', 0);
"""



def _null(value: None) -> None:
    return value


# Python's sqlite3 binds an int, float or str at once, and anything else through the adapter protocol first: for
# None and bool (in every usage row) a search that fails through two AttributeErrors, their messages formatted and
# dropped, about a seventh of the tenancy thread's work per row written. A registered adapter is found at once;
# these bind the same values as before (NULL; 0 and 1).
sqlite3.register_adapter(bool, int)
sqlite3.register_adapter(type(None), _null)

# The UTC date of started_at; the other groups are columns (tables.GROUP_COLUMNS).
DAY_SQL = "strftime('%Y-%m-%d', started_at, 'unixepoch')"


@functools.lru_cache(maxsize=8)
def _insert_usage(rows: int) -> str:
    one = f"({', '.join('?' * len(tables.USAGE_COLUMNS))})"
    return f"INSERT INTO usage ({', '.join(tables.USAGE_COLUMNS)}) VALUES {', '.join([one] * rows)}"


class SqliteStore:
    """store.Store in an SQLite file, made (mode 0600, in a folder made 0700 when missing) with its tables."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._create_file()
        # isolation_level=None: no transaction Python opens by itself; ours are explicit (_write).
        self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)
        try:
            self._wal()
            # A commit is safe from a killed process without an fsync in WAL mode; only the host's crash can
            # lose the last ones (SQLite's "synchronous" documentation).
            self._db.execute("PRAGMA synchronous=NORMAL")
            with self._write() as db:  # two processes that make the file at once: one makes the tables
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
        except BaseException:
            self._db.close()
            raise

    def _wal(self) -> None:
        """Write-ahead logging, set once per file. While another process switches a new file to it, SQLite
        answers "database is locked" at once, without waiting the busy timeout: try again until it is done."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as error:
                if "locked" not in str(error) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _create_file(self) -> None:
        """The file, 0600 from its first moment (SQLite gives its -wal and -shm files the same mode), never
        through a symbolic link; an existing one is used as it is."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=FOLDER_MODE)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        os.close(fd)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, holding the write lock from its start."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def add_key(self, record: KeyRecord) -> None:
        with self._write() as db:
            db.execute(f"INSERT INTO keys ({', '.join(tables.KEY_COLUMNS)}) "
                       f"VALUES ({', '.join('?' * len(tables.KEY_COLUMNS))})", tables.key_row(record))
            db.execute("UPDATE meta SET value = value + 1 WHERE name = ?", (tables.REVISION,))

    def revoke(self, key_id: str, now: float) -> bool:
        with self._write() as db:
            done = db.execute("UPDATE keys SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL", (now, key_id))
            if done.rowcount != 1:
                return False
            db.execute("UPDATE meta SET value = value + 1 WHERE name = ?", (tables.REVISION,))
            return True

    def keys(self) -> list[KeyRecord]:
        rows = self._db.execute(f"SELECT {', '.join(tables.KEY_COLUMNS)} FROM keys ORDER BY created_at, key_id")
        return [tables.key_record(row) for row in rows]

    def revision(self) -> int:
        return tables.revision_value(
            self._db.execute("SELECT value FROM meta WHERE name = ?", (tables.REVISION,)).fetchone())

    def record_usage(self, rows: Sequence[UsageRow]) -> list[tuple[str, int, int, int]]:
        if not rows:
            return []
        counts = tables.minute_counts(rows)
        with self._write() as db:
            for start in range(0, len(rows), ROWS_PER_INSERT):
                chunk = rows[start:start + ROWS_PER_INSERT]
                # a UsageRow is its values in column order; SQLite keeps any truth value of `migrated` as 0 / 1
                db.execute(_insert_usage(len(chunk)), [value for row in chunk for value in row])
            db.executemany(tables.MINUTE_UPSERT.replace("%s", "?"), counts)
        return counts

    def usage(self, by: GroupBy, since: float | None = None, until: float | None = None) -> list[UsageTotal]:
        group = DAY_SQL if by is GroupBy.DAY else tables.GROUP_COLUMNS[by]
        where, params = tables.time_filter("started_at", since, until, "?")
        rows = self._db.execute(f"SELECT {group}, {tables.TOTALS_SQL} FROM usage{where} GROUP BY 1", params)
        totals = rows.fetchall()
        # The median TTFT per group, without fetching the rows: the middle one (odd count) or the mean of the
        # two middle ones (even), by their rank within the group.
        ttft_where = f"{where} AND ttft_s IS NOT NULL" if where else " WHERE ttft_s IS NOT NULL"
        medians = self._db.execute(
            "SELECT grp, AVG(ttft_s) FROM ("
            "  SELECT grp, ttft_s, ROW_NUMBER() OVER (PARTITION BY grp ORDER BY ttft_s) AS pos,"
            "         COUNT(*) OVER (PARTITION BY grp) AS n"
            f"  FROM (SELECT {group} AS grp, ttft_s FROM usage{ttft_where})"
            ") WHERE pos IN ((n + 1) / 2, (n + 2) / 2) GROUP BY grp", params)
        return tables.totals(totals, dict(medians.fetchall()))

    def rows(self, since: float | None = None) -> list[UsageRow]:
        where, params = tables.time_filter("started_at", since, None, "?")
        rows = self._db.execute(f"SELECT {', '.join(tables.USAGE_COLUMNS)} FROM usage{where} ORDER BY started_at, id",
                                params)
        return [tables.usage_record(row) for row in rows]

    def window_counts(self, since_minute: int) -> dict[str, dict[int, WindowCounts]]:
        counts: dict[str, dict[int, WindowCounts]] = {}
        rows = self._db.execute("SELECT key_id, minute, requests, tokens FROM usage_minute WHERE minute >= ?",
                                (since_minute,))
        for key_id, minute, requests, tokens in rows:
            counts.setdefault(key_id, {})[minute] = WindowCounts(requests, tokens)
        return counts

    def close(self) -> None:
        self._db.close()
