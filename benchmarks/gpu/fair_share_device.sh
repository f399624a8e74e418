#!/bin/bash
# Fair share on the GPU device (issue "tenants"): benchmarks/tenancy_fair_share.py's measurement, user A (a
# closed loop that fills the pool) and user B (an open loop at a tenth of A's request rate), on two TP=1
# replicas of the Llama-3.1-8B shape (dummy weights) on the one GPU, each with a small --max-num-seqs so that
# A fills the pool; the data plane's fair share (tenancy on: A's and B's keys) against first come first served
# (tenancy off). One call: the replicas start, fair_share_device.py runs both modes (three phases each: B
# alone, A alone, A and B), the replicas stop. The call sequence is in TENANCY_CALLS.md beside this file.
#
#   bash benchmarks/gpu/fair_share_device.sh run [--budget S]
#
# Its own replicas, not routing_device.sh's: those run at vLLM's default max-num-seqs (A would need thousands
# of streams to fill them) and, with 16 GiB of KV cache each, leave no room on an 80 GB GPU for two more:
# stop them first (routing_device.sh stop); this script refuses to start while the GPU holds more than
# FS_GPU_FREE_MIB (20000) MiB. Ports 8013 and 8014 (replica indices 3 and 4 of device_lib.sh: other vLLM
# internal ports than the routing replicas'). Eager (--enforce-eager): no compile on start (the compile cache
# of the routing replicas does not fit other batch sizes) and no new compile later; started in ~1 min.
# Results under $OUT: summary.txt (the log and the figures), fair_share.json (the whole result),
# raw_run.tar.gz (replica and data-plane logs).
# Knobs: FS_MAX_NUM_SEQS (16: each replica's batch; the pool holds 2 x it), FS_A_IN_FLIGHT (4 x
# FS_MAX_NUM_SEQS: A's streams, twice the pool), FS_TOKENS (128 output tokens a request), FS_VARY_TOKENS (0: all
# alike; 0.5: each request's length uniform within +-50 % of FS_TOKENS), FS_PHASE_S (35),
# FS_B_RATE (0: a tenth of A's request rate alone, measured in a 10 s calibration before the modes), FS_ROUNDS
# (1: rounds of A alone and A and B per mode, the modes taking turns; the figures are the rounds' medians),
# FS_MODES (fair,fcfs; fair,nopause,fcfs adds fair share without pausing A's streams for B; floor: B into a
# running batch at once, the engines' own share of B's time),
# FS_KV_BYTES (4 GiB of KV cache a replica), FS_ENGINE_ARGS (--enforce-eager), FS_WORKERS (1: data-plane
# workers), FS_DIR (/tmp/fairshare: state), BENCH_SRC (the src folder of the data plane; default this
# checkout's), FS_VLLM (a `vllm` stand-in for a CPU dry run, as routing_device.sh's ROUTING_VLLM, with
# BENCH_COMMON="--served-model-name tiny --host 127.0.0.1").
# The replicas serve the names "tiny" (what tenancy_fair_share.py's requests ask for) and "m".
set -uo pipefail
FHERE=$(cd "$(dirname "$0")" && pwd)
export BENCH_DIR=${FS_DIR:-/tmp/fairshare}
S=${FS_MAX_NUM_SEQS:-16}
export BENCH_COMMON=${BENCH_COMMON:---served-model-name tiny m --host 127.0.0.1 --dtype bfloat16 --max-model-len 2048 --disable-custom-all-reduce}
export BENCH_REPLICA_MEM="--gpu-memory-utilization 0.3 --kv-cache-memory-bytes ${FS_KV_BYTES:-4294967296}"
export BENCH_REPLICA_EXTRA="--max-num-seqs $S ${FS_ENGINE_ARGS---enforce-eager}"
[ -n "${FS_VLLM:-}" ] && export BENCH_VLLM=$FS_VLLM
source "$FHERE/device_lib.sh" "$@"   # sets PHASE, BUDGET, OUT, RAW, SUM, MODEL, SRC, replica, stop_tree ...

phase_run() {
  local used t0 rc need
  ensure_model || return 1
  leftovers
  if command -v nvidia-smi >/dev/null; then
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    if [ "${used:-0}" -gt "${FS_GPU_FREE_MIB:-20000}" ]; then
      log "the GPU holds $used MiB already: stop the routing replicas first (routing_device.sh stop)"; return 1
    fi
  fi
  hps_check; [ $HPS_OK = 1 ] || return 1
  # what the measurements take once the replicas serve: calibration, then per mode a warm-up and three
  # phases, each with its streams' tail (~5 s); the rest of the budget is the replicas' start
  modes=${FS_MODES:-fair,fcfs}
  need=$(( 30 + $(tr , '\n' <<< "$modes" | wc -l) * (10 + (1 + 2 * ${FS_ROUNDS:-1}) * (${FS_PHASE_S:-35} + 5)) ))
  t0=$(now)
  replica 3 8013; replica 4 8014
  log "replicas started (max-num-seqs $S, ${BENCH_REPLICA_EXTRA}); fair_share_device.py waits for them"
  PYTHONPATH=$SRC:$FHERE/..:$FHERE timeout $(( $(left) - 15 )) $PY "$FHERE/fair_share_device.py" \
    --urls http://127.0.0.1:8013,http://127.0.0.1:8014 --max-num-seqs "$S" --a-in-flight "${FS_A_IN_FLIGHT:-$((4 * S))}" \
    --tokens "${FS_TOKENS:-128}" --vary-tokens "${FS_VARY_TOKENS:-0}" --phase-s "${FS_PHASE_S:-35}" --b-rate "${FS_B_RATE:-0}" --workers "${FS_WORKERS:-1}" --rounds "${FS_ROUNDS:-1}" --modes "$modes" \
    --ready-s $(( $(left) - need > 30 ? $(left) - need : 30 )) --logs "$RAW" --json "$OUT/fair_share.json" 2> "$RAW/fair_share.err" | tee -a "$SUM"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { log "fair_share_device.py failed (rc $rc)"; tail -20 "$RAW/fair_share.err" | tee -a "$SUM"
                     fail_tail "$RAW/replica3.log"; }
  log "run: $(since "$t0") s since the replicas started"
}

cleanup() { # device_lib.sh's, less its results table (fair_share_device.py prints the figures)
  local p
  for p in "${STARTED[@]}"; do kill -0 "$p" 2>/dev/null && stop_tree "$p"; done
  rm -f "$BENCH_DIR"/pid.*
  tar czf "$OUT/raw_$PHASE.tar.gz" -C "$RAW" . 2>/dev/null
  log "phase $PHASE done"
}

log "phase $PHASE (budget $BUDGET s) on $(hostname); state $BENCH_DIR; model $MODEL"
case $PHASE in
  run) phase_run;;
  *) log "unknown phase $PHASE (run)"; exit 2;;
esac
