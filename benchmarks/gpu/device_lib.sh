#!/bin/bash
# What the device scripts share (startup_device.sh and routing_device.sh source it with their arguments):
# the phase and its --budget from "$@", the state folder ($BENCH_DIR, kept while the machine is warm), the
# files a phase returns under $OUT, the settings of every `vllm serve`, and helpers to start, wait for and
# stop servers (replicas, hpcserve's data plane) and to record results (device_util.py).
# Settings: BENCH_DIR (/tmp/gpubench), BENCH_COMMON (the flags every `vllm serve` shares), BENCH_KV_BYTES,
# BENCH_REPLICA_MEM, BENCH_VLLM (a stand-in server for a dry run), BENCH_SRC (the src folder hpcserve's
# data plane runs from: default this checkout's), BENCH_KEEP (servers outlive the call), BENCH_MODEL_ARGS,
# BENCH_CPU_BIND (vLLM on CPU: "0 1" binds replica 1's threads to core 0, replica 2's to core 1; unset: vLLM's own).
set -uo pipefail
T_START=$(date +%s)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=python3
export PATH="$($PY -c 'import sys,os;print(os.path.dirname(sys.executable))'):$PATH"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 RAY_USAGE_STATS_ENABLED=0
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

PHASE=${1:?phase}; shift
BUDGET=540; ARGS=()
while [ $# -gt 0 ]; do case $1 in --budget) BUDGET=$2; shift 2;; *) ARGS+=("$1"); shift;; esac; done
BENCH_DIR=${BENCH_DIR:-/tmp/gpubench}; mkdir -p "$BENCH_DIR"
OUT=${OUT:-$BENCH_DIR/out}; mkdir -p "$OUT"
RAW=$BENCH_DIR/raw/$PHASE-$(date +%H%M%S); mkdir -p "$RAW"
RES=$BENCH_DIR/results.jsonl; touch "$RES"
SUM=$OUT/summary.txt
# What every `vllm serve` here shares (the flags of the measurements in benchmarks/results/gpu.md); BENCH_COMMON overrides it for a CPU dry run.
COMMON=${BENCH_COMMON:---served-model-name m --host 127.0.0.1 --dtype bfloat16 --max-model-len 2048 --disable-custom-all-reduce}
KV_BYTES=${BENCH_KV_BYTES:-38654705664}   # 36 GiB of KV cache per routing replica (~ --gpu-memory-utilization 0.42)
REPLICA_MEM=${BENCH_REPLICA_MEM:---gpu-memory-utilization 0.42 --kv-cache-memory-bytes $KV_BYTES}
VLLM=${BENCH_VLLM:-vllm}   # a dry run may put a stand-in server here
# Dry-run knobs (CPU): BENCH_MODEL_ARGS (model_folder.py sizes), BENCH_PRE_ARGS / BENCH_MT_ARGS / BENCH_CAL_ARGS (client).
STARTED=()

log() { echo "[+$(( $(date +%s) - T_START ))s] $*" | tee -a "$SUM"; }
now() { date +%s.%N; }
since() { $PY -c "print(round($(now)-$1,1))"; }
left() { echo $(( BUDGET - ($(date +%s) - T_START) )); }
rec() { $PY "$HERE/device_util.py" record "$RES" "$@"; }

pick_base() { # the disk-backed folder with the most room (tmpfs only if no disk has 18 GB free)
  if [ -s "$BENCH_DIR/base" ]; then cat "$BENCH_DIR/base"; return; fi
  local d t avail best="" best_avail=0 any="" any_avail=0
  for d in /tmp /var/tmp /root /opt /home /dev/shm; do
    [ -d "$d" ] && [ -w "$d" ] || continue
    t=$(stat -f -c %T "$d" 2>/dev/null); avail=$(df -P -B1G "$d" 2>/dev/null | awk 'NR==2{print $4}')
    [ "${avail:-0}" -gt $any_avail ] && { any=$d; any_avail=$avail; }
    case $t in tmpfs|ramfs) continue;; esac
    [ "${avail:-0}" -gt $best_avail ] && { best=$d; best_avail=$avail; }
  done
  [ $best_avail -ge 18 ] || best=${any:-/tmp}
  echo "${best:-/tmp}/gpubench-data" | tee "$BENCH_DIR/base"
}
BASE=$(pick_base); mkdir -p "$BASE"
MODEL=$BASE/llama8b
VC=$BASE/vcache

tree_pids() { echo "$1 $($PY "$HERE/device_util.py" tree "$1" 2>/dev/null)"; }
stop_tree() { # PID: SIGTERM to it and its descendants (by id), SIGKILL after 20 s
  local pids p alive i
  pids=$(tree_pids "$1")
  kill -TERM $pids 2>/dev/null
  for i in $(seq 40); do
    alive=0; for p in $pids; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.5
  done
  kill -KILL $pids 2>/dev/null; wait "$1" 2>/dev/null
}
gpu_free() { # until the GPU is nearly empty again
  command -v nvidia-smi >/dev/null || return 0
  local i used
  for i in $(seq 120); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [ "${used:-0}" -lt 1500 ] && return 0; sleep 0.5
  done; log "warning: GPU memory still in use (${used} MiB)"
}
wait_ready() { # URL PID DEADLINE_S [HEADER_FILE]: until a completion answers (with HEADER_FILE's headers, e.g.
  # a key: curl reads them from the file, so no key is on a command line). rc 0 ready, 1 process died, 2 deadline
  local end=$(( $(date +%s) + $3 )) hdr=()
  [ -n "${4:-}" ] && hdr=(-H "@$4")
  while [ "$(date +%s)" -lt $end ]; do
    curl -sf -m 10 "${hdr[@]}" "$1/v1/completions" -H 'Content-Type: application/json' \
      -d '{"model":"m","prompt":"w11 w12 w13 w14","max_tokens":4}' >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.5
  done; return 2
}
fail_tail() { # LOG: last lines of a failed server's log into the summary
  log "---- tail of $1"; tail -n 25 "$1" | cut -c1-300 | tee -a "$SUM"
}
cleanup() {
  local p
  for p in "${STARTED[@]}"; do kill -0 "$p" 2>/dev/null && stop_tree "$p"; done
  rm -f "$BENCH_DIR"/pid.*
  tar czf "$OUT/raw_$PHASE.tar.gz" -C "$RAW" . 2>/dev/null
  cp "$RES" "$OUT/results.jsonl" 2>/dev/null
  { echo "==== results so far"; $PY "$HERE/device_util.py" table "$RES"; } 2>&1 | tee -a "$SUM"
  log "phase $PHASE done"
  [ "$PHASE" = gen ] && touch "$BENCH_DIR/gen.done"
}
trap cleanup EXIT

ensure_cudart() { # fastsafetensors dlopens the unversioned "libcudart.so"; torch's wheels ship only .so.13
  if $PY -c "import ctypes; ctypes.CDLL('libcudart.so')" 2>/dev/null; then log "libcudart.so: found"; return; fi
  local f
  f=$($PY - <<'PY'
import glob, os, sys
c = []
for d in sys.path + ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]:
    if os.path.isdir(d):
        c += glob.glob(os.path.join(d, "nvidia", "**", "libcudart.so*"), recursive=True)
        c += glob.glob(os.path.join(d, "libcudart.so*"))
c = sorted(set(c), key=lambda p: (".so.13" not in p, p))
print(c[0] if c else "")
PY
)
  if [ -z "$f" ]; then log "libcudart.so: none found (fastsafetensors will fail)"; return; fi
  mkdir -p "$BENCH_DIR/cudart"; ln -sf "$f" "$BENCH_DIR/cudart/libcudart.so"
  export LD_LIBRARY_PATH=$BENCH_DIR/cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  log "libcudart.so -> $f (LD_LIBRARY_PATH)"
}

leftovers() { # a server a killed call left behind would hold the GPU: report it (its id), stop it
  local f p
  for f in "$BENCH_DIR"/pid.*; do
    [ -e "$f" ] || continue; p=$(cat "$f")
    if kill -0 "$p" 2>/dev/null && tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -q vllm; then
      log "stopping leftover pid $p ($f)"; stop_tree "$p"
    fi
    rm -f "$f"
  done
}
start_bg() { # NAME LOG CMD...: a background child (no new session: the device ends it with the call)
  local name=$1 logf=$2; shift 2
  if [ -n "${BENCH_KEEP:-}" ]; then # a session of its own: it outlives the call while the machine stays warm
    setsid "$@" > "$logf" 2>&1 < /dev/null &
    BG=$!
  else
    "$@" > "$logf" 2>&1 &
    BG=$!; STARTED+=("$BG")
  fi
  echo "$BG" > "$BENCH_DIR/pid.$name"
}

# ------------------------------------------------------------------ model, replicas, data plane
ensure_model() { # config + tokenizer only (dummy weights): what routing and baseline need; gen adds weights
  [ -f "$MODEL/config.json" ] && return 0
  local j
  j=$($PY "$HERE/model_folder.py" "$MODEL" ${BENCH_MODEL_ARGS:-} 2> "$RAW/model.err") || { log "model folder FAILED"; tail -20 "$RAW/model.err" | tee -a "$SUM"; return 1; }
  log "model folder (no weights): $j"
}
replica() { # IDX PORT
  local bind=""; [ -n "${BENCH_CPU_BIND:-}" ] && bind=$(echo $BENCH_CPU_BIND | cut -d' ' -f"$1")
  VLLM_SERVER_DEV_MODE=1 VLLM_PORT=$((30000 + 1000 * $1)) VLLM_DP_MASTER_PORT=$((40000 + 1000 * $1)) \
    VLLM_CACHE_ROOT=$VC TRITON_CACHE_DIR=$VC/triton-pre TORCHINDUCTOR_CACHE_DIR=$VC/inductor-pre \
    start_bg "replica$1" "$RAW/replica$1.log" ${bind:+env VLLM_CPU_OMP_THREADS_BIND=$bind} $VLLM serve "$MODEL" $COMMON --port "$2" --load-format dummy $REPLICA_MEM \
      ${BENCH_REPLICA_EXTRA:-}   # e.g. --enable-prompt-tokens-details: per-request cached_tokens for the client
}
SRC=${BENCH_SRC:-$(cd "$HERE/../.." && pwd)/src}   # hpcserve's own data plane (hps:POLICY): checkout or snapshot
HPS_SOCK=$BENCH_DIR/hps/admin.sock
HPS_OK=0
hps_check() { # can the device's python run hpcserve.endpoint.dataplane (its imports come with vLLM)?
  local err
  if [ ! -f "$SRC/hpcserve/endpoint/dataplane.py" ] && [ ! -f "$SRC/hpcserve/endpoint/dataplane/__main__.py" ]; then log "hps: no data plane (hpcserve/endpoint/dataplane) in $SRC: hps:* cases skipped"; return; fi
  if err=$(PYTHONPATH=$SRC $PY -c "import hpcserve.endpoint.dataplane, setproctitle, uvloop" 2>&1); then HPS_OK=1; log "hps: data plane importable from $SRC"
  else log "hps: import failed, hps:* cases skipped: $(echo "$err" | tail -3 | tr '\n' ' ' | cut -c1-400)"; fi
}
start_hps() { # POLICY LOG: the data plane on 127.0.0.1:8000, both replicas set over its admin socket
  local i put rl=""   # ROUTING_HPS_LOG=1: its choices in LOG's name .routing.jsonl, where it can write them
  [ -n "${ROUTING_HPS_LOG:-}" ] && grep -qs -- '--routing-log' "$SRC/hpcserve/endpoint/plane_settings.py" "$SRC/hpcserve/endpoint/dataplane/settings.py" \
    && rl="--routing-log ${2%.log}.routing.jsonl"
  start_bg router "$2" env PYTHONPATH="$SRC" $PY -m hpcserve.endpoint.dataplane --host 127.0.0.1 --port 8000 \
    --admin-socket "$HPS_SOCK" --policy "$1" --hold-s 30 ${BENCH_HPS_ARGS:-} $rl   # e.g. --workers 2
  for i in $(seq 60); do
    curl -sf -m 2 --unix-socket "$HPS_SOCK" http://hps/health >/dev/null && break
    kill -0 "$BG" 2>/dev/null || return 1; sleep 0.5
  done
  put=$(curl -s -m 10 --unix-socket "$HPS_SOCK" -X PUT http://hps/backends -H 'Content-Type: application/json' \
    -d "{\"backends\":[{\"url\":\"http://127.0.0.1:8001\",\"capacity\":$HPS_CAP${BENCH_HPS_KV:+,\"kv_tokens\":$BENCH_HPS_KV}},{\"url\":\"http://127.0.0.1:8002\",\"capacity\":$HPS_CAP${BENCH_HPS_KV:+,\"kv_tokens\":$BENCH_HPS_KV}}]}")
  echo "PUT /backends -> $put" >> "$2"
  echo "$put" | grep -q '"backends": *\[{' || return 1
}
hps_metrics() { # N: the data plane's own counters (GET /backends, /metrics on the admin socket) -> compact JSON
  curl -s -m 10 --unix-socket "$HPS_SOCK" http://hps/backends > "$RAW/router_backends_$1.json"
  curl -s -m 10 --unix-socket "$HPS_SOCK" http://hps/metrics > "$RAW/router_metrics_$1.txt"
  $PY - "$RAW/router_backends_$1.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    print(json.dumps({"policy": d.get("policy"), "held": d.get("held"), "requests_by_backend":
        {b["url"][-4:]: b.get("requests") for b in d.get("backends", [])}, "failures_by_backend":
        {b["url"][-4:]: b.get("failures") for b in d.get("backends", [])}, "kv_events_by_backend":
        {b["url"][-4:]: [b.get("kv_events"), b.get("exact_blocks"), b.get("exact_complete")]
         for b in d.get("backends", [])}}))
except Exception as exc:
    print(json.dumps({"error": f"no data plane backends: {exc}"}))
PY
}
