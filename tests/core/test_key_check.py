"""The one check of `Authorization: Bearer KEY` that the data plane, the engines' guard and the monitor
share (core.keys.KeyCheck): the scheme in any case, the token trimmed, compared as hashes."""

from __future__ import annotations

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


def test_the_comparison_is_of_fixed_size_digests():
    # A wrong key of any length is compared as a 32-byte digest: its length cannot show in the time taken.
    check = KeyCheck("k1")
    assert len(check.digest) == 32
