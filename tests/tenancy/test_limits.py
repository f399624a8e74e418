"""The limit decisions (tenancy/limits.py) and the times of `hpcserve keys` (keyring.parse_when): pure."""

from __future__ import annotations

import pytest

from hpcserve.core.errors import UsageError
from hpcserve.tenancy.keyring import parse_when
from hpcserve.tenancy.limits import Window, cap_hit, missing_max_tokens, rate_hit
from hpcserve.tenancy.records import Limits, matches, new_key, split_key

MINUTE_START = 1_800_000_000.0 - 1_800_000_000.0 % 60  # a whole minute


def test_caps_name_the_field_and_the_limit():
    limits = Limits(max_n=4, max_best_of=2, max_tokens=100)
    assert cap_hit(limits, {"n": 4, "best_of": 2, "max_tokens": 100}) is None
    hit = cap_hit(limits, {"n": 10000})
    assert (hit.status, hit.limit) == (400, "max_n") and "n is 10000" in hit.message
    assert cap_hit(limits, {"best_of": 3}).limit == "max_best_of"
    assert cap_hit(limits, {"max_completion_tokens": 101}).limit == "max_tokens"
    assert cap_hit(limits, {"n": "many", "max_tokens": True}) is None  # the engine judges what is no number
    assert missing_max_tokens(limits, {"prompt": "x"}) == 100 and missing_max_tokens(limits, {"max_tokens": 5}) is None
    assert missing_max_tokens(Limits(), {"prompt": "x"}) is None


def test_requests_per_minute_slide_and_say_when_they_reset():
    limits = Limits(requests_per_minute=10)
    now = MINUTE_START + 30  # half the previous minute still counts
    assert rate_hit(limits, Window(previous_requests=10, requests=4), now) is None  # 5 + 4 + 1 = 10
    hit = rate_hit(limits, Window(previous_requests=10, requests=5), now)  # 5 + 5 + 1 = 11
    assert (hit.status, hit.limit) == (429, "requests_per_minute")
    assert hit.retry_after_s == 6  # 9 allowed: the previous minute's weight must fall to 4, 36 s into it
    full = rate_hit(limits, Window(requests=10), MINUTE_START + 50)  # this minute alone is full
    assert full.retry_after_s == 10 + 6  # into the next minute, where these 10 fade until 9 remain
    assert "requests_per_minute = 10" in full.message and f"in {full.retry_after_s} s" in full.message


def test_tokens_per_minute_and_per_day():
    assert rate_hit(Limits(tokens_per_minute=1000), Window(tokens=999), MINUTE_START) is None
    assert rate_hit(Limits(tokens_per_minute=1000), Window(tokens=1000), MINUTE_START).limit == "tokens_per_minute"
    day = rate_hit(Limits(tokens_per_day=5000), Window(day_tokens=5000), 1_800_000_000.0 - 1_800_000_000.0 % 86400 + 86400 - 90)
    assert day.limit == "tokens_per_day" and day.retry_after_s == 90 and "00:00 UTC" in day.message


def test_keys_are_split_and_checked_by_their_hash():
    key, record = new_key("alice")
    key_id, secret = split_key(key.encode())
    assert key_id == record.key_id and matches(record, secret)
    assert not matches(record, secret + b"x") and not matches(None, secret)
    assert secret.decode() not in repr(record) and record.digest != secret  # the secret may hold "_" itself
    for bad in (b"hps_short_x", b"sk-something", b"hps__", b"hps_" + b"0" * 16):
        assert split_key(bad) is None


def test_when_is_a_duration_or_a_date():
    assert parse_when("30d", now=1000.0) == 1000.0 + 30 * 86400
    assert parse_when("12h", now=1000.0, past=True) == 1000.0 - 12 * 3600
    assert parse_when("2027-01-31") == 1801353600.0  # 2027-01-31 00:00 UTC: UTC unless it says otherwise
    assert parse_when("2027-01-31T02:00+02:00") == 1801353600.0
    with pytest.raises(UsageError, match="neither a duration"):
        parse_when("tomorrow")
