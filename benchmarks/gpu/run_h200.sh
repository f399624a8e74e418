#!/bin/bash
# hpcserve against plain vLLM on the H200 device machine (nvidia-h200-x2), after ../shared/gpu's five
# install calls. One phase per device call (each must end within 10 minutes):
#   A: install hpcserve, `hpcserve check`, TP=2 over Ray: hpcserve then plain `vllm serve`, same load
#   B: 2 replicas of TP=1: hpcserve then two plain `vllm serve`, same load; `hpcserve plan`
# Load (the GPU-proof issue): 256 requests, 512 prompt tokens, 128 output tokens, concurrency 32,
# measured by `hpcserve bench` for both sides. Everything lands in $OUT.
set -uo pipefail
PHASE=$1
cd "$(dirname "$0")/../.."
export PATH=$(python3 -c 'import sys,os;print(os.path.dirname(sys.executable))'):$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1
export PYTHONUNBUFFERED=1 HPCSERVE_HOME=/tmp/hpcserve-home HPCSERVE_CACHE=/tmp/hpcserve-cache
LOAD="--num-prompts 256 --concurrency 32 --input-len 512 --output-len 128"
M=/tmp/llama8b
PLAIN="vllm serve $M --served-model-name m --load-format dummy --dtype bfloat16 --max-model-len 2048 --disable-custom-all-reduce"
stamp() { python3 -c 'import time;print(round(time.time(),1))'; }

wait_ready() { # URL PID: until a completion answers (same readiness rule as hpcserve)
  for _ in $(seq 400); do
    curl -sf "$1/v1/completions" -H 'Content-Type: application/json' \
      -d '{"model":"m","prompt":"Hello, my name is","max_tokens":4}' >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1; sleep 0.5
  done; return 1
}

hpcserve_case() { # LABEL CONFIG
  local name t0=$(stamp) rc
  name=$(grep -m1 '^name:' "$2" | awk '{print $2}')
  hpcserve up "$2" > "$OUT/up_$1.log" 2>&1; rc=$?
  echo "hpcserve_$1 up rc=$rc ready_s=$(python3 -c "print(round($(stamp)-$t0,1))")" | tee -a "$OUT/summary.txt"
  tail -12 "$OUT/up_$1.log"
  [ $rc = 0 ] && hpcserve bench "$name" $LOAD --out "$OUT/bench_hpcserve_$1.json" 2>&1 | tail -8
  hpcserve status --json > "$OUT/status_$1.json" 2>&1
  hpcserve down "$name" 2>&1 | tail -2
  mkdir -p "$OUT/logs_$1"; cp /tmp/results/logs/*/timeline.json /tmp/results/logs/*/health.json "$OUT/logs_$1/" 2>/dev/null
  tail -n 30 /tmp/results/logs/*/engines/*.log > "$OUT/logs_$1/engines_tail.txt" 2>/dev/null; rm -rf /tmp/results/logs
}

case $PHASE in
A)
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
  python3 benchmarks/gpu/model_folder.py $M --tokenizer tiny
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
  python3 -c "import vllm, ray, torch; print('vllm', vllm.__version__, 'ray', ray.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpus.txt"
  hpcserve check benchmarks/gpu/h200-tp2.yaml > "$OUT/check.log" 2>&1; echo "check rc=$?" | tee -a "$OUT/summary.txt"
  tail -25 "$OUT/check.log"; cp /tmp/results/logs/*/health.json "$OUT/health.json" 2>/dev/null; rm -rf /tmp/results/logs
  hpcserve_case tp2 benchmarks/gpu/h200-tp2.yaml
  ray start --head --num-gpus=2 --disable-usage-stats > "$OUT/plain_ray.log" 2>&1
  t0=$(stamp); $PLAIN --port 8001 --tensor-parallel-size 2 --distributed-executor-backend ray > "$OUT/plain_tp2.log" 2>&1 & P=$!
  wait_ready http://127.0.0.1:8001 $P; echo "plain_tp2 ready_s=$(python3 -c "print(round($(stamp)-$t0,1))")" | tee -a "$OUT/summary.txt"
  hpcserve bench http://127.0.0.1:8001 $LOAD --out "$OUT/bench_plain_tp2.json" 2>&1 | tail -8
  kill $P; wait $P 2>/dev/null; ray stop --force > /dev/null 2>&1 ;;
B)
  hpcserve_case replicas benchmarks/gpu/h200-replicas.yaml
  ray start --head --num-gpus=2 --disable-usage-stats > "$OUT/plain_ray.log" 2>&1
  t0=$(stamp)
  # Two vLLMs with the Ray executor on one node need distinct store-port windows (see engine/replicas.py).
  VLLM_DP_MASTER_PORT=30100 $PLAIN --port 8001 --distributed-executor-backend ray > "$OUT/plain_r0.log" 2>&1 & P0=$!
  VLLM_DP_MASTER_PORT=30200 $PLAIN --port 8002 --distributed-executor-backend ray > "$OUT/plain_r1.log" 2>&1 & P1=$!
  wait_ready http://127.0.0.1:8001 $P0 && wait_ready http://127.0.0.1:8002 $P1
  echo "plain_replicas ready_s=$(python3 -c "print(round($(stamp)-$t0,1))")" | tee -a "$OUT/summary.txt"
  hpcserve bench http://127.0.0.1:8001 http://127.0.0.1:8002 $LOAD --out "$OUT/bench_plain_replicas.json" 2>&1 | tail -8
  kill $P0 $P1; wait $P0 $P1 2>/dev/null; ray stop --force > /dev/null 2>&1
  hpcserve plan benchmarks/gpu/h200-auto.yaml > "$OUT/plan.txt" 2>&1; tail -12 "$OUT/plan.txt" ;;
esac
nvidia-smi --query-gpu=memory.used --format=csv >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
