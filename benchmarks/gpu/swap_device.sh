#!/bin/bash
# hpcserve's swap on the GPU device: two models on one GPU behind one endpoint, through `hpcserve up` (local
# mode: the endpoint process, one member whose driver starts Ray, the swap model's vLLM engine, puts it to
# sleep, then the deployment's own model, which sleeps and wakes once), then swap_client.py's load: 8 streams
# on one model, the demand moved to the other (the swap under load), back, and a burst for both; the GPU's
# memory and the engines' host RAM with one model asleep; `hpcserve down`, and nothing left running.
# After the install calls of ROUTING_CALLS.md (parts 1-5: vLLM and Ray; the model folder of `routing_device.sh
# model`); one call:
#   bash benchmarks/gpu/swap_device.sh swap [--budget S]
# Knobs: SWAP_ARGS (more `vllm serve` flags of both models; default --enforce-eager, which skips torch.compile
# and CUDA graphs: the swap's sleep and wake are the same), SWAP_MEM (--gpu-memory-utilization of each, 0.80:
# both do not fit awake at once), SWAP_CLIENT_ARGS (swap_client.py's). Results under $OUT: summary.txt,
# swap.json (the client's), swap_status.json (`hpcserve status --json` after the load), raw_swap.tar.gz (the
# endpoint's and member's logs, decisions, engine logs).
source "$(dirname "${BASH_SOURCE[0]}")/device_lib.sh" "$@"
REPO=$(cd "$HERE/../.." && pwd)
SW=$BENCH_DIR/swap; mkdir -p "$SW"
NAME=gpu-swap

write_config() {
  local total
  total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  cat > "$SW/swap.yaml" <<EOF
name: $NAME
model: {path: $MODEL, served_name: llama-a, dtype: bfloat16, max_model_len: 2048}
cluster: {scheduler: local, nodes: 1, gpus_per_node: 1, cpus_per_node: 16, gpu_memory_gb: $(( total / 1024 ))}
parallelism: {tensor: 1, pipeline: 1, replicas: 1}
engine:
  args: [--load-format, dummy, --disable-custom-all-reduce, --gpu-memory-utilization, "${SWAP_MEM:-0.80}", ${SWAP_ARGS:---enforce-eager}]
  env: {NCCL_NVLS_ENABLE: "0", TORCH_SYMM_MEM_DISABLE_MULTICAST: "1", NVSHMEM_DISABLE_NVLS: "1",
        VLLM_ALLREDUCE_USE_SYMM_MEM: "0", VLLM_USE_FLASHINFER_SAMPLER: "0"}
  startup_timeout_s: 300
serve: {host: 127.0.0.1, port: 8100, api_key_env: HPCSERVE_API_KEY, router: true}
swap:
  models: [{path: $MODEL, served_name: llama-b, dtype: bfloat16, max_model_len: 2048}]
  awake: 1
  min_awake_s: 5
  wake_wait_s: 120
results_dir: $SW/results
EOF
  log "config: $(tr '\n' ' ' < "$SW/swap.yaml" | cut -c1-600)"
}

engines_memory() { # LABEL: the GPU's memory per process and the engines' host RAM
  log "$1: GPU $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -1); per process: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';')"
  $PY - "$1" <<'PY' | tee -a "$SUM"
import sys, psutil
rows = []
for p in psutil.process_iter(["pid", "cmdline", "memory_info"]):
    cmd = " ".join(p.info["cmdline"] or [])
    if "vllm_cli serve" in cmd or "VLLM::EngineCore" in cmd or "EngineCore" in (p.info["cmdline"] or [""])[0]:
        rows.append((p.info["pid"], round(p.info["memory_info"].rss / 2**30, 2), cmd.split("--served-model-name ")[-1].split()[0] if "--served-model-name" in cmd else cmd[:40]))
print(f"{sys.argv[1]}: engine processes' RSS GiB: {rows}; MemAvailable GiB {round(psutil.virtual_memory().available / 2**30, 1)}")
PY
}

phase_swap() {
  local t0 rc
  python3 -m pip install -q --no-deps --no-build-isolation -e "$REPO" 2>&1 | tail -2
  command -v hpcserve >/dev/null || { log "hpcserve not installed"; return 1; }
  ensure_model || return 1
  leftovers; gpu_free
  write_config
  export HPCSERVE_HOME=$SW/home HPCSERVE_CACHE=$BENCH_DIR/hpcserve-cache
  HPCSERVE_API_KEY=$($PY -c "import secrets; print(secrets.token_urlsafe(24))"); export HPCSERVE_API_KEY
  engines_memory "before up"
  t0=$(now)
  timeout $(( $(left) - 150 )) hpcserve up "$SW/swap.yaml" > "$SW/up.log" 2>&1; rc=$?
  log "up rc=$rc after $(since "$t0") s"; tail -15 "$SW/up.log" | tee -a "$SUM"
  if [ $rc = 0 ]; then
    engines_memory "ready (llama-a awake, llama-b asleep)"
    hpcserve status "$NAME" 2>&1 | tail -20 | tee -a "$SUM"
    t0=$(now)
    timeout $(( $(left) - 60 )) $PY "$HERE/swap_client.py" http://127.0.0.1:8100 --models llama-a llama-b \
      --json "$OUT/swap.json" ${SWAP_CLIENT_ARGS:-} 2>&1 | tee -a "$SUM"
    log "client took $(since "$t0") s"
    engines_memory "after the load (llama-a awake again)"
    hpcserve status "$NAME" --json > "$OUT/swap_status.json" 2>&1
    hpcserve status "$NAME" 2>&1 | grep -i "swap\|decision" | tail -20 | tee -a "$SUM"
  fi
  t0=$(now)
  hpcserve down "$NAME" > "$SW/down.log" 2>&1; log "down rc=$? after $(since "$t0") s: $(tail -2 "$SW/down.log" | tr '\n' ' ')"
  log "left running: $(ps -eo pid,cmd | grep -E 'vllm|raylet|gcs_server|hpcserve' | grep -v grep | cut -c1-120 | tr '\n' ';')"
  gpu_free; log "GPU after down: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -1)"
  cp -r "$SW/results" "$SW/up.log" "$SW/down.log" "$SW/swap.yaml" "$RAW/" 2>/dev/null
}

log "phase $PHASE (budget $BUDGET s) on $(hostname); state $BENCH_DIR; model $MODEL"
case $PHASE in
  swap) phase_swap;;
  *) log "unknown phase $PHASE (swap)"; exit 2;;
esac
