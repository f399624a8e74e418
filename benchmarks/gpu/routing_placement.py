"""Where each request of a prefix run went, and why a repeat missed the cache: from the replicas' logs.

    python3 benchmarks/gpu/routing_placement.py RAW_FOLDER

RAW_FOLDER: routing_device.sh's raw files of one call (raw_bench.tar.gz unpacked): replica1.log and
replica2.log of replicas started with --enable-log-requests, and client_*.requests.jsonl of runs made with
prefix_client.py --request-ids (each request's id names its run, prefix and position; vLLM logs
"Received request cmpl-<id>" on the replica that served it). Per run: requests and distinct prefixes per
replica, prefixes served by both, and the repeats that missed (cached tokens below the prefix's whole
blocks), split into
  split    the first request of a prefix on the second replica it went to (the prefix was elsewhere)
  again    a miss on a replica that had already served that prefix in this run (evicted there, or sent
           before the first one's prefill stored it; or it overtook the first one, which then hit: no loss)
and how many of each were among the first C requests sent (the first wave: C = the client's concurrency).
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

RECEIVED = re.compile(r"Received request cmpl-(?P<run>\S+?)\.g(?P<g>\d+)\.i(?P<i>\d+)\b")


def placements(folder: Path) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for replica in (1, 2):
        path = folder / f"replica{replica}.log"
        if path.exists():
            for m in RECEIVED.finditer(path.read_text(errors="replace")):
                out[(m["run"], int(m["i"]))] = replica
    return out


def run_report(path: Path, where: dict) -> dict | None:
    run = path.name[: -len(".requests.jsonl")]
    cfg = json.loads(path.with_name(run + ".json").read_text())["config"]
    full = cfg["prefix_len"] // cfg["block"] * cfg["block"]
    recs = sorted((json.loads(x) for x in path.read_text().splitlines()), key=lambda r: r["i"])
    if not any((run, r["i"]) in where for r in recs):
        return None
    reqs, prefixes = defaultdict(int), defaultdict(set)
    seen: dict[int, list[int]] = defaultdict(list)  # group -> replicas in the order first used
    served: set[tuple[int, int]] = set()
    split = again = split_wave = again_wave = lost = unknown = 0
    for r in recs:
        rep = where.get((run, r["i"]))
        if rep is None:
            unknown += 1
            continue
        g, wave = r["group"], r["i"] < cfg["concurrency"]
        reqs[rep] += 1
        prefixes[rep].add(g)
        missed = (r.get("cached_tokens") or 0) < full
        if missed:
            lost += full - (r.get("cached_tokens") or 0)
        if (g, rep) not in served:
            if seen[g] and missed:  # the prefix was sent elsewhere first
                split += 1
                split_wave += wave
            seen[g].append(rep)
            served.add((g, rep))
        elif missed:
            again += 1
            again_wave += wave
    groups = len(seen)
    return {"run": run, "requests": dict(sorted(reqs.items())),
            "prefixes": {k: len(v) for k, v in sorted(prefixes.items())},
            "on_both": sum(1 for v in seen.values() if len(v) > 1), "groups": groups,
            "split_misses": split, "split_in_first_wave": split_wave,
            "again_misses": again, "again_in_first_wave": again_wave,
            "hit_tokens_lost": lost - groups * full, "unplaced": unknown}


def main() -> int:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    folder = Path(sys.argv[1])
    where = placements(folder)
    rows = [x for p in sorted(folder.glob("client_*.requests.jsonl"), key=lambda p: int(p.name.split("_")[1]))
            if (x := run_report(p, where))]
    print("| run | requests r1/r2 | prefixes r1/r2 | on both | split misses (first wave) "
          "| again misses (first wave) | hit tokens lost beyond each prefix's first |")
    print("|---|---|---|---|---|---|---|")
    for x in rows:
        q, p = x["requests"], x["prefixes"]
        print(f"| {x['run']} | {q.get(1, 0)}/{q.get(2, 0)} | {p.get(1, 0)}/{p.get(2, 0)} | {x['on_both']} | "
              f"{x['split_misses']} ({x['split_in_first_wave']}) | {x['again_misses']} ({x['again_in_first_wave']}) | "
              f"{x['hit_tokens_lost']:,}{' (' + str(x['unplaced']) + ' unplaced)' if x['unplaced'] else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
