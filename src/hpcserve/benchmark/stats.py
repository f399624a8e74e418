"""The one percentile every figure of the project uses (`hpcserve bench`, the benchmarks, their tables).

No dependencies beyond the standard library: the device scripts import it where only the project is installed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100) of values, None when there are none.

    Linear interpolation between the two nearest order statistics (rank (n - 1) * q / 100): numpy's
    default and what `vllm bench serve` reports, so figures compare with vLLM's. p0 is the minimum, p100
    the maximum, and p50 of an even count the mean of the middle two.
    """
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
