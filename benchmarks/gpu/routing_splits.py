"""Prefixes whose requests the data plane sent to more than one replica, from its --routing-log files
(routing_device.sh / routing_cpu.sh with ROUTING_HPS_LOG=1 keep them in raw_bench.tar.gz as
router_N_POLICY.routing.jsonl): for each such prefix, every request's time, worker, replica chosen, and what
each replica was seen to hold of it just before ([share, in flight, cache fill]).

usage: routing_splits.py ROUTING_JSONL...
"""

from __future__ import annotations

import collections
import json
import sys


def main(paths: list[str]) -> None:
    for path in paths:
        lines = sorted((json.loads(line) for line in open(path)), key=lambda line: line["t"])
        if not lines:
            continue
        start, prefixes = lines[0]["t"], collections.defaultdict(list)
        for number, line in enumerate(lines):
            prefixes[tuple(line["head"])].append((number, line))
        split = {head: sent for head, sent in prefixes.items() if len({line["to"] for _, line in sent}) > 1}
        print(f"{path}: {len(lines)} requests, {len(prefixes)} prompts' heads, {len(split)} sent to both replicas")
        for sent in split.values():
            for number, line in sent:
                seen = {url.rsplit(":", 1)[-1]: view for url, view in line["seen"].items()}
                print(f"  #{number:<4} {line['t'] - start:7.3f} s  worker {line['pid']}  -> "
                      f"{line['to'].rsplit(':', 1)[-1]}  seen {seen}")
            print()


if __name__ == "__main__":
    main(sys.argv[1:])
