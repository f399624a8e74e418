"""The data plane's side of tenancy in memory (tenancy.view, endpoint.dataplane.tenants): verified keys remembered
by a keyed digest and forgotten at every reload, each key's window kept as running sums (the same counts as summed
afresh), and a whole answer's usage read as the JSON decoder reads it."""

from __future__ import annotations

import json
import random
import time

import pytest

from hpcserve.endpoint.dataplane.tenants import Visit
from hpcserve.tenancy.keyring import add_key, revoke
from hpcserve.tenancy.limits import DAY_S
from hpcserve.tenancy.records import Limits
from hpcserve.tenancy.store import open_store
from hpcserve.tenancy.view import Meter, TenantView, _Counts

OWNER_KEY = "the-deployments-own-key"


@pytest.fixture
def view_and_store(tmp_path):
    database = tmp_path / "tenancy.sqlite"
    store = open_store(database)
    view = TenantView(lambda: open_store(database), OWNER_KEY, Limits(), flush_s=0.0)
    polled = view.poll(None)
    yield view, store
    view.poll(polled, stopping=True)
    store.close()


def test_a_verified_key_is_remembered_by_a_digest_and_forgotten_when_revoked(view_and_store):
    view, store = view_and_store
    key, record = add_key(store, "alice", project="chem", limits=Limits(requests_per_minute=5))
    polled = view.poll(None)
    now = time.time()
    tenant = view.identify(f"Bearer {key}", now)
    assert tenant is not None and tenant.user == "alice" and tenant.project == "chem"
    assert view.identify(f"Bearer {key}", now) is tenant  # remembered
    secret = key.rsplit("_", 1)[1].encode()
    assert len(view.verified) == 1 and all(secret not in digest for digest in view.verified)
    wrong = key[:-2] + ("AA" if not key.endswith("AA") else "BB")
    assert view.identify(f"Bearer {wrong}", now) is None and len(view.verified) == 1  # a refusal is not remembered
    assert view.identify(f"Bearer {OWNER_KEY}", now) is view.owner_tenant
    assert view.identify(f"Bearer {OWNER_KEY}", now) is view.owner_tenant
    assert view.identify("Bearer nobody", now) is None and view.identify(None, now) is None
    revoke(store, record.key_id)
    view.poll(polled)  # the thread's reload: the keys as they are now, and nothing remembered
    assert not view.verified
    assert view.identify(f"Bearer {key}", time.time()) is None


def test_a_remembered_key_is_refused_once_it_expires(view_and_store):
    view, store = view_and_store
    now = time.time()
    key, _ = add_key(store, "bob", expires_at=now + 60)
    view.poll(None)
    assert view.identify(f"Bearer {key}", now) is not None
    assert view.identify(f"Bearer {key}", now + 59) is not None
    assert view.identify(f"Bearer {key}", now + 60) is None


def test_admit_counts_a_request_and_refuses_past_the_rate(view_and_store):
    view, store = view_and_store
    key, _ = add_key(store, "carol", limits=Limits(requests_per_minute=3))
    view.poll(None)
    now = 1_800_000_000.0 - 1_800_000_000.0 % 60 + 1  # early in a minute: the previous one (empty) weighs little
    tenant = view.identify(f"Bearer {key}", now)
    assert tenant is not None
    assert [view.admit(tenant, {}, now) for _ in range(3)] == [None, None, None]
    hit = view.admit(tenant, {}, now)
    assert hit is not None and hit.status == 429 and hit.limit == "requests_per_minute"
    assert "requests_per_minute = 3" in hit.message and hit.retry_after_s is not None


def summed_window(meter: Meter, key_id: str, minute: int) -> tuple[int, int, int, int, int]:
    """A key's window summed afresh from the stored counts and the worker's own: what the running sums must equal."""
    stored = meter.stored.get(key_id, {})
    own = meter.own.get(key_id, {})
    day_start = minute - minute % (DAY_S // 60)

    def at(m: int) -> tuple[int, int]:
        counts = own.get(m, _Counts())
        stored_r, stored_t = stored.get(m, (0, 0))
        return stored_r + counts.requests, stored_t + counts.tokens

    day = (meter.stored_day.get(key_id, 0) + sum(t for m, (_, t) in stored.items() if m >= day_start)
           + sum(c.tokens for m, c in own.items() if m >= day_start))
    (previous_r, previous_t), (now_r, now_t) = at(minute - 1), at(minute)
    return previous_r, previous_t, now_r, now_t, day


@pytest.mark.parametrize("seed", range(20))
def test_the_running_windows_equal_the_windows_summed_afresh(seed):
    rng = random.Random(seed)
    meter = Meter()
    keys = ["k1", "k2", "k3"]
    minute = 1440 * 20_000 - 3  # a day's last minutes: the day's start moves within the run
    for _ in range(400):
        key = rng.choice(keys)
        action = rng.random()
        if action < 0.05:
            minute += 1
        elif action < 0.45:
            if rng.random() < 0.5:
                meter.window(key, minute)
            meter.began(key, minute)
        elif action < 0.8:
            meter.ended(key, minute - rng.choice([0, 0, 0, 1, 2]), rng.randrange(0, 50))
        elif action < 0.9:  # the thread: what it read, and what it wrote (in the store now, out of `own`)
            written = [(k, m, c.requests, c.tokens) for k, minutes in meter.own.items() for m, c in minutes.items()
                       if rng.random() < 0.5]
            meter.swap({k: {m: (rng.randrange(5), rng.randrange(100)) for m in (minute - 1, minute)} for k in keys},
                       {k: rng.randrange(1000) for k in keys} if rng.random() < 0.5 else None)
            meter.written(written)
        # every count kept is of some request (a window looked at and a refusal leave nothing behind)
        assert all(c.requests > 0 or c.tokens > 0 for minutes in meter.own.values() for c in minutes.values())
        for check in keys:
            window = meter.window(check, minute)
            assert (window.previous_requests, window.previous_tokens, window.requests, window.tokens,
                    window.day_tokens) == summed_window(meter, check, minute)


def decoded_counts(body: bytes) -> tuple[int | None, int | None, int | None]:
    """The counts as the JSON decoder reads the whole answer (the reference for Visit.whole_answer)."""
    try:
        usage = json.loads(body).get("usage")
    except ValueError:
        return None, None, None
    if not isinstance(usage, dict):
        return None, None, None

    def count(value):
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    details = usage.get("prompt_tokens_details")
    return (count(usage.get("prompt_tokens")), count(usage.get("completion_tokens")),
            count(details.get("cached_tokens")) if isinstance(details, dict) else None)


USAGES = [
    '{"prompt_tokens":9,"total_tokens":25,"completion_tokens":16,"prompt_tokens_details":null}',  # vLLM
    '{"prompt_tokens":9,"total_tokens":25,"completion_tokens":16,"prompt_tokens_details":{"cached_tokens":8}}',
    '{"prompt_tokens":9,"total_tokens":25,"completion_tokens":16}',
    '{"prompt_tokens": 1, "completion_tokens": 16, "total_tokens": 17}',  # the stand-in
    '{"prompt_tokens":0,"total_tokens":0,"completion_tokens":0}',
    '{"completion_tokens":16,"prompt_tokens":9,"total_tokens":25}',  # another order: the decoder reads it
    ('{"prompt_tokens":9,"total_tokens":25,"completion_tokens":16,"prompt_tokens_details":{"cached_tokens":8,'
     '"audio_tokens":0}}'),
    '{"prompt_tokens":9.0,"total_tokens":25,"completion_tokens":16}',
    '{"prompt_tokens":-1,"total_tokens":25,"completion_tokens":16}',
    '{"prompt_tokens":true,"total_tokens":25,"completion_tokens":16}',
    '{"prompt_tokens":1e3,"total_tokens":25,"completion_tokens":16}',
    '{"prompt_tokens":01,"total_tokens":25,"completion_tokens":16}',  # no JSON: no counts
    '{"prompt_tokens":9,"total_tokens":25,"completion_tokens":16,"prompt_tokens_details":{"cached_tokens":null}}',
    'null',
    '{}',
]


@pytest.mark.parametrize("usage", USAGES)
def test_a_whole_answers_usage_is_read_as_the_json_decoder_reads_it(usage):
    body = ('{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"a \\"usage\\": {","finish_reason":'
            f'"length"}}],"usage":{usage},"kv_transfer_params":null}}').encode()
    visit = Visit(None, "/v1/completions", "m", 0.0, 0.0)  # type: ignore[arg-type]
    visit.whole_answer(body)
    assert (visit.prompt_tokens, visit.completion_tokens, visit.cached_tokens) == decoded_counts(body), usage
