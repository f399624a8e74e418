#!/usr/bin/env bash
# `hpcserve baseline` on the sandbox as a user runs it: the two-replica example of the
# tests (tests/cluster/sandbox-replicas.yaml: two nodes, one replica each) against its single-node cut,
# the same load on both. Root, a 2-core machine: the sandbox's nodes share its cores.
#   bash benchmarks/sandbox_baseline.sh OUT_FOLDER [hpcserve baseline options]
# Writes OUT_FOLDER/{baseline.md, single.json, multi.json, *.png, baseline.log}; leaves the sandbox down.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "$1"); shift
mkdir -p "$out"
work=$(mktemp -d)
hpcserve=".venv/bin/hpcserve"
trap '$hpcserve down sb-reps >/dev/null 2>&1 || true; $hpcserve down sb-reps-single >/dev/null 2>&1 || true; $hpcserve sandbox down >/dev/null 2>&1 || true' EXIT
$hpcserve sandbox up --nodes 3
eval "$($hpcserve sandbox env)"
export HPCSERVE_HOME="$work/home"
HPCSERVE_API_KEY="bench-$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n')"
export HPCSERVE_API_KEY
sed -e "s#^results_dir: .*#results_dir: $work/results#" tests/cluster/sandbox-replicas.yaml > "$work/reps.yaml"
$hpcserve baseline "$work/reps.yaml" "$@" 2>&1 | tee "$out/baseline.log"
cp "$work/results/logs/sb-reps/baseline/"* "$out/"
echo "written: $out"
