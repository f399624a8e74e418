"""The routing benchmark's bounds on prefix-cache hits (benchmarks/gpu/prefix_client.py): Belady's optimal
eviction and LRU (the engines' own), on one cache of both replicas' blocks. Pure functions."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))
from prefix_client import belady_hits, lru_hits  # noqa: E402


def test_everything_fits_every_repeat_hits_whole():
    sequence = [1, 2, 1, 3, 2, 1]
    assert lru_hits(sequence, 10, 30) == belady_hits(sequence, 10, 30) == 30  # three repeats of 10 blocks


def test_lru_evicts_the_least_recent_tail_first_where_belady_keeps_what_comes_back():
    # room for 2 prefixes of 10 blocks: A B C A B. LRU drops A for C, then B for A, then C for B: no hit.
    # Belady drops what comes back last (C itself, i.e. keeps A and B): A and B hit.
    sequence = [1, 2, 3, 1, 2]
    assert lru_hits(sequence, 10, 20) == 0
    assert belady_hits(sequence, 10, 20) == 20


def test_lru_keeps_the_leading_blocks_of_a_prefix_it_evicts_in_part():
    # room for 15 blocks: A (10), then B (10) pushes out A's last 5; A comes back and hits its first 5
    assert lru_hits([1, 2, 1], 10, 15) == 5
