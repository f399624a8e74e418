"""The one check of `Authorization: Bearer KEY` that the data plane, the engines' guard and the monitor
share (core.keys.KeyCheck): the scheme in any case, the token trimmed, compared as hashes."""

from __future__ import annotations

import hashlib

from hpcserve.core import keys
from hpcserve.core.keys import KeyCheck, bearer_token


def test_the_scheme_in_any_case_and_the_token_trimmed():
    assert bearer_token("Bearer k1") == b"k1" and bearer_token(b"bearer k1") == b"k1"
    assert bearer_token("  BEARER   k1  ") == b"k1"
    for value in (None, "", "Bearer", "Bearer ", "Basic k1", "k1"):
        assert bearer_token(value) is None


def test_only_the_key_passes_and_without_a_key_everything_does():
    check = KeyCheck("k1")
    assert check.allows("Bearer k1") and check.allows(" bearer k1 ") and check.allows(b"Bearer k1")
    for wrong in (None, "", "Bearer k2", "Bearer k1x", "Bearer k", "k1", "Basic k1", "Bearer \udcff"):
        assert not check.allows(wrong), wrong
    assert KeyCheck(None).allows(None) and KeyCheck("").allows("anything")


def test_the_comparison_is_of_fixed_size_digests(monkeypatch):
    # A wrong key of any length is compared with hmac.compare_digest, as two 32-byte SHA-256 digests: its
    # length cannot show in the time taken. The calls are recorded where KeyCheck makes them (core.keys' hmac).
    key = "k1-the-stored-key"
    check = KeyCheck(key)
    compared: list[tuple[bytes, bytes]] = []
    real = keys.hmac.compare_digest

    def recording(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(keys.hmac, "compare_digest", recording)
    candidates = [b"w" * length for length in (1, 2, 1000)] + [key.encode()]
    for candidate in candidates:
        assert check.allows(b"Bearer " + candidate) is (candidate == key.encode())
    assert len(compared) == len(candidates)  # every candidate, right or wrong, through compare_digest
    stored = hashlib.sha256(key.encode()).digest()
    for pair, candidate in zip(compared, candidates, strict=True):
        assert [type(side) for side in pair] == [bytes, bytes] and [len(side) for side in pair] == [32, 32], pair
        assert sorted(pair) == sorted((hashlib.sha256(candidate).digest(), stored))  # digests, not the texts
    # The key is not kept in clear: nothing the check holds is the key or contains it.
    held = [getattr(check, name) for name in KeyCheck.__slots__]
    assert not hasattr(check, "__dict__") and held == [stored]
