"""`--routing-log FILE`: one JSON line per request the prefix policy routes, saying what each replica was
seen to hold of the prompt just before the choice and where the request went. It answers "why did this
repeat miss its cache" (benchmarks/results/routing.md) from the data plane's side, where vLLM's request log
only says where a request went. Off by default: it costs a pass over the pool per request.

    {"t": 1796480000.12, "pid": 4242, "head": [17, 9, 311, 5], "blocks": 16, "to": "http://10.0.0.6:8001",
     "seen": {"http://10.0.0.5:8001": [0.9375, 12, 0.41], "http://10.0.0.6:8001": [0.0, 3, 0.38]}}

`seen` per replica: [the part of the prompt it holds (table.cached_share), its requests in flight through
this worker, its cache fill (table.cache_fill)]; `head`: the prompt's first token ids (a prompt's name).
Every worker of a data plane appends to the same file, one line per write.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hpcserve.core.statuses import Routing
from hpcserve.endpoint.dataplane.routing import choose
from hpcserve.endpoint.dataplane.routing.table import Affinity, Backend, RoutingTable, cache_fill, cached_share

HEAD_TOKENS = 4


def seen(pool: RoutingTable, affinity: Affinity, now: float) -> dict[str, list[float]]:
    """What the prefix policy sees of one prompt, replica by replica. Pure."""
    return {b.url: [round(cached_share(pool, b.url, affinity, now), 4), b.in_flight,
                    round(cache_fill(pool, b.url, now), 4)] for b in pool.active}


class RoutingLog:
    def __init__(self, path: Path):
        # Open for the process's life; line-buffered: one write per line, whole among workers.
        self.file = open(path, "a", buffering=1)  # noqa: SIM115

    def choose(self, pool: RoutingTable, policy: Routing, affinity: Affinity | None, now: float,
               tried: tuple[Backend, ...] = ()) -> Backend | None:
        """routing.choose, written down."""
        if affinity is None or not affinity.has_prompt:
            return choose(pool, policy, affinity, now, tried)
        before = seen(pool, affinity, now)
        chosen = choose(pool, policy, affinity, now, tried)
        if chosen is not None:
            self.file.write(json.dumps({"t": round(time.time(), 3), "pid": os.getpid(),
                                        "head": (affinity.tokens or [])[:HEAD_TOKENS], "blocks": len(affinity.blocks),
                                        "to": chosen.url, "seen": before}) + "\n")
        return chosen
