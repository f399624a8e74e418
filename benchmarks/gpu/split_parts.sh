#!/bin/bash
# Re-cuts the wheel bundle's 60 MiB parts p1, p2, p4 and p5 (../shared/gpu/make_bundle.sh) so that each call to
# the device carries less than 64 MiB with the checkout: a call carrying p2 (62.9 MB) beside a 3.8 MB checkout was
# refused on 2026-12-05, one carrying p1 (61.6 MB) beside the 6.4 MB checkout of b399ad0 on 2026-12-06. The first
# 57 MiB of ray.a, vllm.a and vllm.b go into q2, q4 and q5, their last 3 MiB ride with part 3 (q3, 56 MB); the
# first 57 MiB of p1's small.tar go into q1, the rest (1.9 MB) with p1's install.sh into q1t, a call of its own.
# ROUTING_CALLS.md says which call carries which.
#   bash benchmarks/gpu/split_parts.sh .gpu
set -euo pipefail
G=${1:-.gpu}; M=$((57 * 1024 * 1024))
rm -rf "$G"/q1 "$G"/q1t "$G"/q2 "$G"/q3 "$G"/q4 "$G"/q5; mkdir -p "$G"/q1 "$G"/q1t "$G"/q2 "$G"/q3 "$G"/q4 "$G"/q5
cp "$G"/p3/* "$G"/q3/; cp "$G"/p5/NAMES "$G"/q5/; cp "$G"/p1/install.sh "$G"/q1t/
head -c $M "$G"/p1/small.tar > "$G"/q1/small.tar.1; tail -c +$((M + 1)) "$G"/p1/small.tar > "$G"/q1t/small.tar.2
cat "$G"/q1/small.tar.1 "$G"/q1t/small.tar.2 | cmp -s - "$G"/p1/small.tar
cut_part() { # FILE DIR_OF_HEAD: the head into DIR_OF_HEAD/NAME.1, the tail into q3/NAME.2
  head -c $M "$1" > "$2/$(basename "$1").1"; tail -c +$((M + 1)) "$1" > "$G/q3/$(basename "$1").2"
  cat "$2/$(basename "$1").1" "$G/q3/$(basename "$1").2" | cmp -s - "$1"
}
cut_part "$G"/p2/ray.a "$G"/q2; cut_part "$G"/p4/vllm.a "$G"/q4; cut_part "$G"/p5/vllm.b "$G"/q5
du -sb "$G"/q1 "$G"/q1t "$G"/q2 "$G"/q3 "$G"/q4 "$G"/q5
