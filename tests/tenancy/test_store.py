"""Both stores of tenancy's records (an SQLite file, a real PostgreSQL server) keep and answer the same: keys
with every field, revocation and the revision the data plane polls, usage totals per group and window, the
per-minute counts limits read, and rows written by two processes at once, each counted once."""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime

import pytest

from hpcserve.core.osenv import umask
from hpcserve.tenancy.postgres import PostgresStore
from hpcserve.tenancy.records import KeySource, Limits, UsageRow, new_key
from hpcserve.tenancy.sqlite import SqliteStore
from hpcserve.tenancy.store import GroupBy, Store, UsageTotal, WindowCounts, open_store
from hpcserve.testing.postgres import create_database

DAY = 86_400
T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC: its day ends 1 h 46 min later
_databases = itertools.count()


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path) -> str:
    """Where a fresh store lives: a new SQLite file in a folder not made yet, or a new database."""
    if request.param == "sqlite":
        return str(tmp_path / "tenancy" / "store.db")
    return create_database(request.getfixturevalue("postgres_url"), f"test_{next(_databases)}")


@pytest.fixture
def store(store_url):
    opened = open_store(store_url)
    yield opened
    opened.close()


def usage(started_at: float, key_id: str = "k1", user: str = "alice", *, project: str | None = "p1",
          model: str | None = "m1", status: int = 200, prompt: int | None = 10, cached: int | None = 0,
          completion: int | None = 5, ttft: float | None = 0.5, duration: float = 1.0,
          migrated: bool = False) -> UsageRow:
    return UsageRow(started_at, key_id, user, project, model, "/v1/chat/completions", status, prompt, cached,
                    completion, ttft, duration, migrated)


def test_open_store_picks_the_store_by_url(store, store_url):
    assert isinstance(store, PostgresStore if store_url.startswith("postgresql://") else SqliteStore)


def test_keys_keep_every_field_oldest_first_and_survive_reopening(store, store_url):
    _, full = new_key("alice", project="climate", models=("llama-8b", "qwen-72b"),
                      limits=Limits(requests_per_minute=60, tokens_per_minute=10_000, tokens_per_day=1_000_000,
                                    max_n=2, max_best_of=3, max_tokens=4096),
                      source=KeySource.SELF_SERVICE, expires_at=T0 + 30 * DAY, now=T0)
    _, older = new_key("bob", now=T0 - 100)  # no project, every model, no limits, admin's, no expiry
    _, no_model = new_key("carol", models=(), limits=Limits(max_n=1), now=T0 + 1)  # () is no model at all
    for record in (full, older, no_model):
        store.add_key(record)

    assert store.keys() == [older, full, no_model]
    kept = store.keys()[1]
    assert kept.models == ("llama-8b", "qwen-72b") and isinstance(kept.models, tuple)
    assert kept.source is KeySource.SELF_SERVICE and kept.limits.max_tokens == 4096
    assert isinstance(kept.salt, bytes) and isinstance(kept.digest, bytes)
    assert store.keys()[2].models == () and store.keys()[0].models is None

    store.close()
    again = open_store(store_url)  # the tables exist now: opening again makes nothing and loses nothing
    try:
        assert again.keys() == [older, full, no_model]
        assert again.revision() == 3
    finally:
        again.close()


def test_revoke_once_and_revision_moves_on_every_change(store):
    _, record = new_key("alice", now=T0)
    assert store.revision() == 0
    store.add_key(record)
    assert store.revision() == 1

    assert store.revoke(record.key_id, T0 + 5) is True
    assert store.revision() == 2
    assert store.keys()[0].revoked_at == T0 + 5 and not store.keys()[0].usable(T0 + 6)

    assert store.revoke(record.key_id, T0 + 9) is False  # already revoked: kept as it was
    assert store.revoke("0123456789abcdef", T0 + 9) is False  # no such key
    assert store.keys()[0].revoked_at == T0 + 5
    assert store.revision() == 2  # nothing changed: the data plane has nothing to reload


def expected_totals(rows: list[UsageRow], by: GroupBy, since: float | None, until: float | None) -> list[UsageTotal]:
    """usage() worked out in Python, the plain way."""
    groups: dict[str, list[UsageRow]] = {}
    for row in rows:
        if (since is not None and row.started_at < since) or (until is not None and row.started_at >= until):
            continue
        if by is GroupBy.DAY:
            group = datetime.fromtimestamp(row.started_at, UTC).strftime("%Y-%m-%d")
        else:
            group = {GroupBy.USER: row.user, GroupBy.PROJECT: row.project, GroupBy.MODEL: row.model}[by] or "-"
        groups.setdefault(group, []).append(row)
    out = []
    for group, members in sorted(groups.items()):
        ttfts = [row.ttft_s for row in members if row.ttft_s is not None]
        out.append(UsageTotal(group, len(members), sum(row.status >= 400 for row in members),
                              sum(row.prompt_tokens or 0 for row in members),
                              sum(row.cached_tokens or 0 for row in members),
                              sum(row.completion_tokens or 0 for row in members),
                              sum(row.migrated for row in members),
                              statistics.median(ttfts) if ttfts else None,
                              sum(row.duration_s for row in members)))
    return out


def assert_totals_equal(got: list[UsageTotal], want: list[UsageTotal]) -> None:
    assert [t.group for t in got] == [t.group for t in want]
    for g, w in zip(got, want):
        assert g.__dict__ | {"ttft_p50_s": None, "duration_s": None} == w.__dict__ | {"ttft_p50_s": None,
                                                                                      "duration_s": None}
        assert g.ttft_p50_s == pytest.approx(w.ttft_p50_s) and g.duration_s == pytest.approx(w.duration_s)


USAGE_ROWS = [
    usage(T0, ttft=0.2),
    usage(T0 + 60, status=500, ttft=None, duration=0.25),
    usage(T0 + 120, user="bob", key_id="k2", project=None, prompt=None, completion=None, cached=None, ttft=0.9),
    usage(T0 + 3 * 3600, ttft=0.4, migrated=True, cached=6),  # the next UTC day
    usage(T0 + 3 * 3600 + 2, ttft=2.0, prompt=1, completion=1, duration=0.5),  # a median is not a mean
    usage(T0 + 3 * 3600 + 5, user="bob", key_id="k2", model=None, status=499, ttft=0.1),
    usage(T0 + DAY + 3 * 3600, user="carol", key_id="k3", model="m2", ttft=0.3, prompt=100, completion=50),
    usage(T0 + DAY + 3 * 3600 + 1, user="carol", key_id="k3", model="m2", ttft=0.7, status=429, duration=2.5),
]


@pytest.mark.parametrize("by", list(GroupBy))
def test_usage_totals_per_group_and_window(store, by):
    store.record_usage(USAGE_ROWS[4:])  # two batches, the later rows first: order of writing changes nothing
    store.record_usage(USAGE_ROWS[:4])
    for since, until in [(None, None), (T0 + 60, None), (None, T0 + 3 * 3600), (T0 + 60, T0 + DAY + 3 * 3600 + 1),
                         (T0 + 10 * DAY, None)]:
        assert_totals_equal(store.usage(by, since, until), expected_totals(USAGE_ROWS, by, since, until))


@pytest.fixture
def far_from_utc():
    """This process's local time zone 14 h from UTC (the test PostgreSQL server's is too): a day that follows
    the local zone instead of UTC shows."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "Pacific/Kiritimati"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def test_usage_totals_by_hand(store, far_from_utc):
    """The reference above, checked against numbers worked out by hand; days are UTC's."""
    store.record_usage(USAGE_ROWS)
    alice, bob, carol = store.usage(GroupBy.USER)
    assert alice == UsageTotal("alice", requests=4, failed=1, prompt_tokens=31, cached_tokens=6, completion_tokens=16,
                               migrated=1, ttft_p50_s=pytest.approx(0.4), duration_s=pytest.approx(2.75))
    assert (bob.requests, bob.failed, bob.prompt_tokens, bob.ttft_p50_s) == (2, 1, 10, pytest.approx(0.5))
    assert (carol.failed, carol.prompt_tokens, carol.completion_tokens) == (1, 110, 55)
    assert [t.group for t in store.usage(GroupBy.DAY)] == ["2023-11-14", "2023-11-15", "2023-11-16"]
    assert [t.group for t in store.usage(GroupBy.PROJECT)] == ["-", "p1"]
    assert [t.group for t in store.usage(GroupBy.MODEL)] == ["-", "m1", "m2"]
    only_failed = store.usage(GroupBy.USER, since=T0 + 60, until=T0 + 61)
    assert only_failed == [UsageTotal("alice", 1, 1, 10, 0, 5, 0, None, 0.25)]  # no TTFT: no median


def test_rows_oldest_first_and_since(store):
    store.record_usage([USAGE_ROWS[3], USAGE_ROWS[0], USAGE_ROWS[2]])
    store.record_usage([USAGE_ROWS[1]])
    store.record_usage([])
    assert store.rows() == USAGE_ROWS[:4]
    assert store.rows(since=T0 + 60) == USAGE_ROWS[1:4]
    assert store.rows()[3].migrated is True and store.rows()[2].prompt_tokens is None


def test_window_counts_per_key_and_minute(store):
    minute = int(T0 // 60)
    start = minute * 60
    store.record_usage([usage(start + 1, prompt=3, completion=4), usage(start + 59.9, prompt=None, completion=2),
                        usage(start + 60, key_id="k2", prompt=1, completion=None)])
    store.record_usage([usage(start + 30, prompt=10, completion=10),  # the same minute again: added, not replaced
                        usage(start - 0.5, prompt=100, completion=100)])  # the minute before

    assert store.window_counts(minute - 1) == {
        "k1": {minute - 1: WindowCounts(1, 200), minute: WindowCounts(3, 29)},
        "k2": {minute + 1: WindowCounts(1, 1)},
    }
    assert store.window_counts(minute + 1) == {"k2": {minute + 1: WindowCounts(1, 1)}}
    assert store.window_counts(minute + 2) == {}


# The start of every child's script: its arguments, and wait_for_go(), which returns when all children
# called it (the test's run_together starts them together there).
CHILD = """
import sys, time
from pathlib import Path
from hpcserve.tenancy.records import UsageRow, new_key
from hpcserve.tenancy.store import open_store

folder, name, url, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3], [int(arg) for arg in sys.argv[4:]]

def wait_for_go():
    (folder / f"ready-{name}").touch()
    while not (folder / "go").exists():
        time.sleep(0.002)
"""


def run_together(script: str, names: list[str], url: str, args: list[int], folder) -> None:
    """One process per name runs CHILD + script; they pass wait_for_go() together. All must succeed."""
    children = [subprocess.Popen([sys.executable, "-c", CHILD + script, str(folder), name, url, *map(str, args)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for name in names]
    deadline = time.monotonic() + 60
    while not all((folder / f"ready-{name}").exists() for name in names):
        assert time.monotonic() < deadline and all(child.poll() is None for child in children), \
            [child.communicate()[0][-500:] for child in children if child.poll() is not None]
        time.sleep(0.005)
    (folder / "go").touch()
    outputs = [child.communicate(timeout=60)[0] for child in children]
    assert [child.returncode for child in children] == [0] * len(names), [out[-500:] for out in outputs]


WRITER = """
batches, size, start = args
store = open_store(url)
wait_for_go()
for batch in range(batches):
    store.record_usage([UsageRow(start + (batch * size + i) % 180, f"k{i % 3}", name, None, "m", "/v1/completions",
                                 200, 2, 0, 3, 0.1, 0.5) for i in range(size)])
store.close()
"""


def test_two_processes_writing_at_once_count_every_row_once(store, store_url, tmp_path):
    batches, size, start = 30, 6, int(T0 // 60) * 60  # 180 rows each: every second of 3 minutes once
    run_together(WRITER, ["w1", "w2"], store_url, [batches, size, start], tmp_path)

    each = batches * size
    assert len(store.rows()) == 2 * each
    assert [(t.group, t.requests, t.prompt_tokens) for t in store.usage(GroupBy.USER)] == \
        [("w1", each, 2 * each), ("w2", each, 2 * each)]
    counts = store.window_counts(0)
    assert sum(c.requests for minutes in counts.values() for c in minutes.values()) == 2 * each
    assert sum(c.tokens for minutes in counts.values() for c in minutes.values()) == 2 * each * 5
    assert counts["k0"] == {start // 60 + m: WindowCounts(2 * each // 9, 2 * each // 9 * 5) for m in range(3)}


OPENER = """
wait_for_go()
store = open_store(url)
store.add_key(new_key(name)[1])
store.close()
"""


def test_processes_that_open_a_new_store_at_once_make_its_tables_once(store_url, tmp_path):
    """Data-plane workers (or hosts) that start together all find the store missing and make its tables."""
    run_together(OPENER, [f"u{i}" for i in range(6)], store_url, [], tmp_path)
    store = open_store(store_url)
    try:
        records = store.keys()
        assert sorted(record.user for record in records) == [f"u{i}" for i in range(6)]
        assert store.revision() == 6
    finally:
        store.close()


def test_sqlite_file_and_folder_are_the_owners_alone(tmp_path):
    path = tmp_path / "made" / "tenancy.db"
    with umask(0):  # the modes do not depend on the caller's umask
        store = SqliteStore(path)
    try:
        _, record = new_key("alice", now=T0)
        store.add_key(record)
        store.record_usage([usage(T0)])
        made = {p.name: p.stat().st_mode & 0o777 for p in path.parent.iterdir()}
    finally:
        store.close()
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert made["tenancy.db"] == 0o600
    assert made.get("tenancy.db-wal", 0o600) == 0o600 and made.get("tenancy.db-shm", 0o600) == 0o600


def test_sqlite_store_is_what_a_plain_path_or_sqlite_url_opens(tmp_path):
    for url in (tmp_path / "a.db", f"sqlite://{tmp_path / 'b.db'}"):
        store: Store = open_store(url)
        try:
            assert isinstance(store, SqliteStore) and store.revision() == 0
        finally:
            store.close()
    assert (tmp_path / "a.db").is_file() and (tmp_path / "b.db").is_file()
