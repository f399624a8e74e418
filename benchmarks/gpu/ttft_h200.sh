#!/bin/bash
# Issue 10, parts 3 and 4: hpcserve (TP=1, Ray executor) against plain `vllm serve` with the same
# arguments on one H200, measured by vLLM's own client (`vllm bench serve`), runs in alternating order,
# with each run's time to ready and whether vLLM's compile cache was cold or warm.
# Runs on the device machine after ../shared/gpu's five install calls:
#   bash benchmarks/gpu/ttft_h200.sh setup          install hpcserve, build the model folder
#   bash benchmarks/gpu/ttft_h200.sh RUN... [--budget S]
# RUN is SIDE:CACHE with SIDE plain | hpc | plainrw (plain vLLM started as a Ray worker would start it:
# nice 15, OMP_NUM_THREADS=1, oom_score_adj 1000) and CACHE warm | cold (cold: ~/.cache/vllm removed
# first; a fresh machine's first run is cold for every cache). A run is skipped if it might not end
# within the budget (seconds since the script started; default 560). Results land in $OUT:
# summary.txt, runs.jsonl (one line per run) and raw.tar.gz (vllm bench JSON, timelines, process dumps).
set -uo pipefail
cd "$(dirname "$0")/../.."
T_START=$(date +%s)
export PATH=$(python3 -c 'import sys,os;print(os.path.dirname(sys.executable))'):$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1
export PYTHONUNBUFFERED=1 HPCSERVE_HOME=/tmp/hpcserve-home HPCSERVE_CACHE=/tmp/hpcserve-cache
M=/tmp/llama8b
CFG=benchmarks/gpu/h200-tp1-ray.yaml
RAW=/tmp/ttft-raw; mkdir -p $RAW
W=$(dirname "$0")
# One key for both sides (vLLM checks it on every request either way); generated here, never printed.
KEY_FILE=/tmp/ttft-key; [ -s $KEY_FILE ] || python3 -c 'import secrets;print(secrets.token_hex(16))' > $KEY_FILE
export HPCSERVE_API_KEY=$(cat $KEY_FILE); export OPENAI_API_KEY=$HPCSERVE_API_KEY
# The same vLLM arguments hpcserve builds (engine/args.py) for this config, port aside.
ARGS="--served-model-name m --host 127.0.0.1 --tensor-parallel-size 1 --pipeline-parallel-size 1
      --distributed-executor-backend ray --dtype bfloat16 --max-model-len 2048 --load-format dummy
      --disable-custom-all-reduce"

now() { python3 -c 'import time;print(f"{time.time():.2f}")'; }
since() { python3 -c "print(round($(now)-$1,1))"; }
log() { echo "[+$(( $(date +%s) - T_START ))s] $*" | tee -a "$OUT/summary.txt"; }

wait_ready() { # URL PID: until a completion answers (hpcserve's readiness rule)
  for _ in $(seq 600); do
    curl -sf "$1/v1/completions" -H 'Content-Type: application/json' -H "Authorization: Bearer $HPCSERVE_API_KEY" \
      -d '{"model":"m","prompt":"Hello, my name is","max_tokens":4}' >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1; sleep 0.5
  done; return 1
}

gpu_free() { # until the GPU is nearly empty again (the next server wants 90% of it)
  for _ in $(seq 120); do
    [ "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)" -lt 2000 ] && return 0; sleep 0.5
  done; log "warning: GPU memory still in use"; }

bench() { # NAME PORT
  vllm bench serve --backend vllm --base-url "http://127.0.0.1:$2" --endpoint /v1/completions --model m \
    --tokenizer $M --dataset-name random --random-input-len 512 --random-output-len 128 --ignore-eos \
    --num-prompts 256 --max-concurrency 32 --num-warmups 32 --seed 0 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
    --save-result --result-dir $RAW --result-filename "bench_$1.json" > "$RAW/bench_$1.log" 2>&1
  grep -E "Output token throughput|Median TTFT|P99 TTFT|Median TPOT|Successful requests" "$RAW/bench_$1.log" | tr -s ' ' | paste -sd'|' | tee -a "$OUT/summary.txt"
}

record() { # NAME SIDE CACHE READY_S [EXTRA_JSON]
  python3 - "$@" <<'PY' >> "$OUT/runs.jsonl"
import json, sys
from pathlib import Path
name, side, cache, ready = sys.argv[1:5]
extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
raw = Path("/tmp/ttft-raw")
try:
    b = json.loads((raw / f"bench_{name}.json").read_text())
    keep = ["completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
            "p99_tpot_ms", "median_itl_ms", "median_e2el_ms", "total_input_tokens", "total_output_tokens"]
    bench = {k: b.get(k) for k in keep}
except (OSError, ValueError):
    bench = None
print(json.dumps({"name": name, "side": side, "cache": cache, "ready_s": float(ready), **extra, "bench": bench}))
PY
}

run_plain() { # NAME CACHE [as-ray-worker]
  local t0 p pre=""
  [ "${3:-}" = rw ] && pre="nice -n 15 env OMP_NUM_THREADS=1"
  t0=$(now)
  ray start --head --num-gpus=1 --num-cpus=16 --include-dashboard=false --disable-usage-stats > "$RAW/ray_$1.log" 2>&1
  local ray_s=$(since $t0) t1=$(now)
  VLLM_API_KEY=$HPCSERVE_API_KEY $pre vllm serve $M $ARGS --port 8001 > "$RAW/serve_$1.log" 2>&1 & p=$!
  [ "${3:-}" = rw ] && echo 1000 > /proc/$p/oom_score_adj
  if wait_ready http://127.0.0.1:8001 $p; then
    local ready=$(since $t0) serve_ready=$(since $t1)
    log "$1 ready_s=$ready (ray start $ray_s s, vllm serve $serve_ready s) cache=$2"
    [ -n "${DUMP:-}" ] && python3 $W/procinfo.py "$1" "$RAW/proc_$1.json"
    bench "$1" 8001
    record "$1" "plain${3:+-$3}" "$2" "$ready" \
      "{\"ray_start_s\": $ray_s, \"serve_ready_s\": $serve_ready, \"compile_cache\": \"$(cache_state "$RAW/serve_$1.log")\"}"
  else
    log "$1 FAILED to get ready"; tail -20 "$RAW/serve_$1.log"
  fi
  kill $p; wait $p 2>/dev/null; ray stop --force > /dev/null 2>&1; gpu_free
}

run_hpc() { # NAME CACHE
  local t0=$(now) rc
  hpcserve up $CFG > "$RAW/up_$1.log" 2>&1; rc=$?
  local ready=$(since $t0)
  log "$1 up rc=$rc ready_s=$ready cache=$2"; tail -4 "$RAW/up_$1.log"
  if [ $rc = 0 ]; then
    [ -n "${DUMP:-}" ] && python3 $W/procinfo.py "$1" "$RAW/proc_$1.json"
    bench "$1" 8000
    hpcserve status h200-tp1 --json > "$RAW/status_$1.json" 2>&1
  fi
  hpcserve down h200-tp1 > "$RAW/down_$1.log" 2>&1
  mkdir -p "$RAW/logs_$1"
  cp /tmp/results/logs/*/timeline.json /tmp/results/logs/*/state.json "$RAW/logs_$1/" 2>/dev/null
  tail -n 40 /tmp/results/logs/*/engines/*.log > "$RAW/logs_$1/engine_tail.txt" 2>/dev/null
  local stages=$(python3 -c "
import json,glob
t=json.load(open(glob.glob('$RAW/logs_$1/timeline.json')[0])); s={}
for e in t:
    s.setdefault(e['stage'],{})[e['event']]=e['time']
print(json.dumps({k:{ev:round(v-$t0,1) for ev,v in d.items()} for k,d in s.items()}))" 2>/dev/null || echo '{}')
  log "$1 stages (s after \`up\` started): $stages"
  local cache=$(cache_state /tmp/results/logs/*/engines/*.log)
  [ $rc = 0 ] && record "$1" hpc "$2" "$ready" "{\"stages\": $stages, \"compile_cache\": \"$cache\"}"
  rm -rf /tmp/results/logs; gpu_free
}

cache_state() { # LOG...: what vLLM's log says about its compile cache (the label asked for may not hold)
  if grep -q "Directly load the compiled graph" "$@" 2>/dev/null; then echo hit
  elif grep -q "Compiling a graph" "$@" 2>/dev/null; then echo miss; else echo unknown; fi
}

estimate() { # SIDE CACHE: seconds a run may take, start to GPU free (generous)
  case "$1:$2" in hpc:cold) echo 230;; hpc:*) echo 180;; *:cold) echo 170;; *) echo 130;; esac
}

if [ "${1:-}" = setup ]; then
  # .gpu/snap (if carried): a copy of pyproject.toml + src taken when the tree was known good, so that
  # edits made here between device calls cannot change what is measured.
  if [ -d .gpu/snap ]; then python3 -m pip install -q --no-deps --no-build-isolation ./.gpu/snap 2>&1 | tail -2
  else python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2; fi
  python3 -c "import hpcserve.engine.host as h; print('hpcserve from', h.__file__)" | tee -a "$OUT/summary.txt"
  python3 benchmarks/gpu/model_folder.py $M --tokenizer tiny
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/summary.txt"
  python3 -c "import vllm, ray, torch; print('vllm', vllm.__version__, 'ray', ray.__version__, 'torch', torch.__version__)" | tee -a "$OUT/summary.txt"
  nproc | tee -a "$OUT/summary.txt"
  exit 0
fi

BUDGET=560; RUNS=()
while [ $# -gt 0 ]; do
  case $1 in --budget) BUDGET=$2; shift 2;; *) RUNS+=("$1"); shift;; esac
done
N=$(ls $RAW/bench_*.json 2>/dev/null | wc -l)
for spec in "${RUNS[@]}"; do
  side=${spec%%:*}; cache=${spec#*:}; N=$((N + 1)); name="$N-$side-$cache"
  left=$(( BUDGET - ($(date +%s) - T_START) ))
  if [ $left -lt "$(estimate $side $cache)" ]; then log "$name skipped: $left s left"; continue; fi
  [ "$cache" = cold ] && rm -rf ~/.cache/vllm
  if [ $N -le 2 ] || [ -n "${DUMP_ALL:-}" ]; then export DUMP=1; else unset DUMP; fi
  case $side in
    plain) run_plain $name $cache;;
    plainrw) run_plain $name $cache rw;;
    hpc) run_hpc $name $cache;;
  esac
done
tar czf "$OUT/raw.tar.gz" -C $RAW . 2>/dev/null
cp "$OUT/summary.txt" /tmp/ttft-summary-so-far.txt 2>/dev/null
cat "$OUT/runs.jsonl" 2>/dev/null | cut -c1-400
