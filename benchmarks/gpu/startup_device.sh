#!/bin/bash
# How fast vLLM starts on the H200 device machine (after ../shared/gpu's install calls): weight loading and
# loaders, the compile cache's warm start; also the first routing comparison (vllm-router's policies and
# hpcserve's data plane) and `hpcserve baseline`. One phase per device call (settings and helpers:
# device_lib.sh); the sequences of calls that ran are in benchmarks/results/gpu.md (2026-12-02 sections).
# State that must outlive a call (model folder, compile cache, results so far) stays on the machine
# (under /tmp/gpubench and the disk folder named in /tmp/gpubench/base) while it is warm, i.e. while calls follow
# each other within 30 s. Each phase returns at most 4 files under $OUT: summary.txt (its log lines and
# the tables so far), results.jsonl (every result of every phase so far), raw_PHASE.tar.gz (server,
# router and client logs of this phase), and nothing deeper.
#
#   gen                       model folder (Llama-3.1-8B shape) + 16.06 GB random bf16 safetensors on a
#                             disk-backed folder; page-cache checks (drop_caches, posix_fadvise, read GB/s)
#   model                     the model folder without weights (config + tokenizer: enough for dummy weights)
#   pyc                       byte-compile the vllm package (so a cold start measures torch.compile only)
#   micro [--budget S]        vLLM 0.26's weight iterators alone, cold page cache (weight_loaders.py)
#   ready CASE... [--budget S]
#                             time to ready (first completion) of plain `vllm serve`, one server at a time:
#                             compile:cold   --load-format dummy, empty VLLM_CACHE_ROOT (+ Triton/Inductor dirs)
#                             compile:warm   the same, cache kept from the runs before
#                             load:auto      real weights, default loader, model files evicted first
#                             load:auto-warm real weights, default loader, files left in the page cache
#                             load:best      real weights, the fastest working loader of `micro`
#                             load:NAME      NAME: runai_streamer fastsafetensors instanttensor prefetch
#                                            multithread8 eager
#   routing [WORKLOAD:POLICY...] [--budget S]
#                             two replicas on the one GPU + vllm-router 0.1.17; WORKLOAD pre | mt | cal | vb | rnd
#                             (rnd: no shared prefix, 800 prompts of 512 tokens, 128 out, 64 in flight),
#                             POLICY round_robin | cache_aware | consistent_hash | power_of_two | random
#                             | hps:prefix | hps:least_loaded | hps:round_robin (hpcserve's own data plane,
#                             hpcserve.endpoint.dataplane from src/, instead of vllm-router on port 8000)
#                             WORKLOAD@R (pre, cal, rnd, vb; e.g. pre@16:hps:prefix): open loop, Poisson arrivals
#                             at R requests/s (the client's --request-rate; no in-flight cap: BENCH_OPEN_CAP,
#                             default 4096) instead of the closed loop at the workload's concurrency
#   baseline [--budget S]     `hpcserve baseline` of a one-node TP=1 deployment of the model
#                             folder (dummy weights), hpcserve installed --no-deps from $BENCH_SNAP (a copy of the
#                             committed pyproject.toml + src); its folder (baseline.md, JSON, plots) under $OUT
# A step is skipped (and says so) when it might not end within the budget (seconds since the phase began).
# BENCH_SRC: the src folder the data plane (hps:*) runs from (default: this checkout's src; use a snapshot of
# the committed tree when others edit the checkout). The prompts of pre/cal/rnd use the words w3..w9999
# (--vocab 10000, 6 characters a token): vLLM 0.26 refuses, before tokenizing, a prompt of more than
# 7 x (max-model-len - max_tokens) characters, and the full vocabulary's ~7.1 characters a token crossed it.
source "$(cd "$(dirname "$0")" && pwd)/device_lib.sh" "$@"   # PHASE, BUDGET, ARGS, OUT, RAW, RES, SUM, MODEL, helpers

# ------------------------------------------------------------------ gen
phase_gen() {
  log "base folder $BASE ($(stat -f -c %T "$BASE"), $(df -P -BG "$BASE" | awk 'NR==2{print $4}') free)"
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; uname -r; nproc
    free -g | head -2; df -h /tmp "$BASE" | tail -n +2; stat -f -c '/tmp: %T' /tmp
    $PY -c "import torch, safetensors, transformers; print('torch', torch.__version__, 'safetensors', safetensors.__version__, 'transformers', transformers.__version__)"
  } 2>&1 | tee -a "$SUM"
  local t0 j
  t0=$(now)
  j=$($PY "$HERE/model_folder.py" "$MODEL" --weights ${BENCH_MODEL_ARGS:-} 2> "$RAW/gen.err") || { log "model build FAILED"; tail -20 "$RAW/gen.err" | tee -a "$SUM"; return 1; }
  log "model: $j (wall $(since "$t0") s)"; rec phase=gen step=model "result=$j"
  du -sh "$MODEL" | tee -a "$SUM"
  # resident after writing; whether drop_caches works here; posix_fadvise eviction; a cold read (after the
  # eviction: what "cold" costs on this disk) and a warm one (page cache)
  local steps="resident dropcaches evict readbw readbw"
  [ -n "${BENCH_NO_DROPCACHES:-}" ] && steps="resident evict readbw readbw"   # dry runs on a shared machine
  for step in $steps; do
    j=$($PY "$HERE/pagecache.py" $step "$MODEL" 2>&1 | tail -1)
    log "pagecache $step: $j"; rec phase=gen step=$step "result=$j"
  done
}
wait_gen() { # gen may run in the background (started with setsid in an earlier call): wait for it
  local i
  if [ ! -e "$BENCH_DIR/gen.done" ] && [ -s "$BENCH_DIR/gen.pid" ]; then
    log "waiting for the background gen (pid $(cat "$BENCH_DIR/gen.pid")) to finish"
    for i in $(seq 300); do
      [ -e "$BENCH_DIR/gen.done" ] && break; kill -0 "$(cat "$BENCH_DIR/gen.pid")" 2>/dev/null || break; sleep 1
    done
  fi
  if [ -s "$BENCH_DIR/out-gen/summary.txt" ] && [ ! -e "$BENCH_DIR/gen.reported" ]; then
    { echo "==== background gen (earlier calls)"; cat "$BENCH_DIR/out-gen/summary.txt"; tail -5 "$BENCH_DIR/gen.console"; } | tee -a "$SUM"
    cp "$BENCH_DIR/out-gen/raw_gen.tar.gz" "$OUT/" 2>/dev/null; touch "$BENCH_DIR/gen.reported"
  fi
  [ -e "$BENCH_DIR/gen.done" ] || log "warning: gen has not finished (see $BENCH_DIR/gen.console)"
}

# ------------------------------------------------------------------ pyc
phase_pyc() { # the install parts used --no-compile: write the .pyc files now, for every package there
  local d t0 rc
  d=$($PY -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('vllm').submodule_search_locations[0]))")
  t0=$(now)
  timeout $(( $(left) - 10 )) $PY -m compileall -q -j 16 -x '/tests?/' "$d" > "$RAW/compileall.log" 2>&1; rc=$?
  log "byte-compiled $d in $(since "$t0") s (rc $rc; 124 = cut off by the budget)"
}

# ------------------------------------------------------------------ micro
phase_micro() {
  wait_gen
  [ -f "$MODEL/model.safetensors.index.json" ] || { log "no model at $MODEL: run gen first"; return 1; }
  ensure_cudart
  $PY -c "import runai_model_streamer, fastsafetensors, instanttensor, vllm; print('vllm', vllm.__version__, '| fastsafetensors', fastsafetensors.__version__)" 2>&1 | tail -2 | tee -a "$SUM"
  local avail; avail=$(df -P -B1G "$BASE" | awk 'NR==2{print $4}')
  local stage=(--stage-dir "$BASE/stage")
  [ "${avail:-0}" -ge 20 ] || { stage=(); log "only ${avail} GB free: no staging copy"; }
  $PY "$HERE/weight_loaders.py" all "$MODEL" "$RES" --logdir "$RAW" --budget $(( $(left) - 15 )) "${stage[@]}" 2>&1 | tee -a "$SUM"
  log "best non-default loader for load:best -> $($PY "$HERE/device_util.py" best "$RES")"
}

# ------------------------------------------------------------------ ready
loader_args() {
  case $1 in
    auto) echo "";;
    runai_streamer) echo "--load-format runai_streamer";;
    fastsafetensors) echo "--load-format fastsafetensors";;
    instanttensor) echo "--load-format instanttensor";;
    prefetch) echo "--safetensors-load-strategy prefetch";;
    multithread8) echo '--model-loader-extra-config {"enable_multithread_load":true,"num_threads":8}';;
    eager) echo "--safetensors-load-strategy eager";;
    *) echo "UNKNOWN";;
  esac
}
run_ready() { # CASE
  local case=$1 n=$2 real=1 evict=1 lname=auto largs="" est=130 dl ev='"none"' t0 rc ready pid logf
  case $case in
    compile:cold) real=0; est=230; lname=dummy;;
    compile:warm) real=0; est=105; lname=dummy;;
    load:auto) ;;
    load:auto-warm) evict=0;;
    load:best) IFS='|' read -r lname largs <<< "$($PY "$HERE/device_util.py" best "$RES")";;
    load:*) lname=${case#load:}; largs=$(loader_args "$lname");;
    *) log "unknown case $case"; return;;
  esac
  [ "$largs" = UNKNOWN ] && { log "unknown loader $lname"; return; }
  if [ "$(left)" -lt $est ]; then log "$case skipped: $(left) s left (needs ~$est)"; rec phase=ready case=$case ok=false skipped=true; return; fi
  gpu_free
  [ $case = compile:cold ] && rm -rf "$VC"
  [ $case = compile:warm ] && [ ! -d "$VC" ] && log "warning: compile:warm with no cache folder (it will compile)"
  mkdir -p "$VC/triton-pre" "$VC/inductor-pre"
  if [ $real = 1 ]; then
    [ -f "$MODEL/model.safetensors.index.json" ] || { log "$case: no weights at $MODEL"; return; }
    if [ $evict = 1 ]; then ev=$($PY "$HERE/pagecache.py" evict "$MODEL" | tail -1)
    else ev=$($PY "$HERE/pagecache.py" resident "$MODEL" | tail -1); fi
  fi
  local fmt=""; [ $real = 0 ] && fmt="--load-format dummy"
  logf=$RAW/serve_${n}_${case//:/-}.log
  dl=$(( $(left) - 15 )); [ $dl -gt 480 ] && dl=480
  log "$case: vllm serve $fmt $largs (deadline ${dl} s; page cache: $ev)"
  t0=$(now)
  VLLM_CACHE_ROOT=$VC TRITON_CACHE_DIR=$VC/triton-pre TORCHINDUCTOR_CACHE_DIR=$VC/inductor-pre \
    start_bg ready "$logf" $VLLM serve "$MODEL" $COMMON --port 8001 $fmt $largs
  pid=$BG
  wait_ready http://127.0.0.1:8001 $pid $dl; rc=$?
  ready=$(since "$t0")
  stop_tree $pid; rm -f "$BENCH_DIR/pid.ready"
  local ls; ls=$($PY "$HERE/device_util.py" logstats "$logf")
  if [ $rc = 0 ]; then log "$case ($lname) ready_s=$ready  $ls"
  else log "$case ($lname) FAILED (rc $rc: 1 died, 2 deadline) after $ready s"; fail_tail "$logf"; fi
  # where the compile artefacts landed (what a shared cache must hold): MiB per folder, two levels
  local cmb; cmb=$(cd "$VC" 2>/dev/null && du -m --max-depth=2 . 2>/dev/null | sort -k2 | awk '{printf "%s=%s ", $2, $1}')
  [ "${case%%:*}" = compile ] && log "  compile cache MiB: $cmb"
  rec phase=ready case=$case loader=$lname ok=$([ $rc = 0 ] && echo true || echo false) ready_s=$ready \
      "log=$ls" "pagecache=$ev" "args=$fmt $largs" run=$n "cache_mib=$cmb"
  gpu_free
}
phase_ready() {
  wait_gen
  ensure_cudart
  local i=0 c
  for c in "${ARGS[@]}"; do i=$((i + 1)); run_ready "$c" $i; done
}

# ------------------------------------------------------------------ routing
phase_routing() {
  ensure_model || return 1
  local runs=("${ARGS[@]}")
  # by value: the prefill-bound load (vllm-router's policies against hpcserve's data plane), then multi-turn,
  # then the calibration's concurrency (32); the budget drops the tail
  [ ${#runs[@]} = 0 ] && runs=(pre:round_robin pre:hps:prefix pre:cache_aware mt:round_robin mt:hps:prefix
                               mt:cache_aware pre:hps:least_loaded mt:consistent_hash cal:round_robin cal:hps:prefix)
  case " ${runs[*]}" in *:hps:*) hps_check;; esac
  # the data plane's capacity per backend: the replicas' --max-num-seqs (vLLM's default unless BENCH_HPS_CAP)
  HPS_CAP=${BENCH_HPS_CAP:-256}
  gpu_free
  mkdir -p "$VC/triton-pre" "$VC/inductor-pre"
  local t0 p1 p2 rc1 rc2
  t0=$(now)
  replica 1 8001; p1=$BG
  replica 2 8002; p2=$BG
  wait_ready http://127.0.0.1:8001 $p1 360; rc1=$?
  wait_ready http://127.0.0.1:8002 $p2 120; rc2=$?
  log "replicas started together: rc $rc1/$rc2 after $(since "$t0") s"
  if [ $rc1 != 0 ] || [ $rc2 != 0 ]; then # one at a time then (the second sees the first's memory)
    [ $rc1 != 0 ] && { fail_tail "$RAW/replica1.log"; stop_tree $p1; cp "$RAW/replica1.log" "$RAW/replica1.first.log"; replica 1 8001; p1=$BG; wait_ready http://127.0.0.1:8001 $p1 300; rc1=$?; }
    [ $rc2 != 0 ] && { fail_tail "$RAW/replica2.log"; stop_tree $p2; cp "$RAW/replica2.log" "$RAW/replica2.first.log"; replica 2 8002; p2=$BG; wait_ready http://127.0.0.1:8002 $p2 300; rc2=$?; }
    log "replicas after retry: rc $rc1/$rc2 after $(since "$t0") s"
  fi
  local l1 l2; l1=$($PY "$HERE/device_util.py" logstats "$RAW/replica1.log"); l2=$($PY "$HERE/device_util.py" logstats "$RAW/replica2.log")
  rec phase=routing step=replicas ok=$([ $rc1 = 0 ] && [ $rc2 = 0 ] && echo true || echo false) ready_s=$(since "$t0") "r1=$l1" "r2=$l2"
  log "replica 1: $l1"; log "replica 2: $l2"
  [ $rc1 = 0 ] && [ $rc2 = 0 ] || { fail_tail "$RAW/replica1.log"; fail_tail "$RAW/replica2.log"; return 1; }
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU memory: /' | tee -a "$SUM"
  local K; K=$(echo "$l1" | $PY -c 'import json,sys; print(int(json.load(sys.stdin).get("kv_cache_tokens") or 294912))')
  # Working sets sized on the KV cache: ~1.3x one replica's tokens, ~0.65x the pool's. Every request fits
  # --max-model-len 2048: pre 1900+100+16, cal/vb 1850+100+64, mt at most 5*(250+48)+250+48 = 1788.
  local P=$(( (13 * K) / (10 * 1900) )) S=$(( (12 * K) / (10 * 1788) ))
  log "KV cache per replica: $K tokens -> pre/cal: $P prefixes of 1900 tokens ($(( P * 1900 )) tokens), mt: $S sessions"
  local i=0 spec wl pol pn cargs est seed rp rrc rate tag
  for spec in "${runs[@]}"; do
    i=$((i + 1)); wl=${spec%%:*}; pol=${spec#*:}; pn=${pol//:/-}; seed=$((1000 + i)); rate=""
    case $wl in *@*) rate=${wl#*@}; wl=${wl%%@*};; esac
    tag=$wl; [ -n "$rate" ] && tag=${wl}_r$rate
    case $wl in
      pre) est=60; cargs=(${BENCH_PRE_ARGS:---mode prefix --vocab 10000 --num-prefixes $P --prefix-len 1900 --suffix-len 100 --output-len 16 --num-requests $((4 * P)) --concurrency 128});;
      cal) est=75; cargs=(${BENCH_CAL_ARGS:---mode prefix --vocab 10000 --num-prefixes $P --prefix-len 1850 --suffix-len 100 --output-len 64 --num-requests $((4 * P)) --concurrency 32});;
      rnd) est=50; cargs=(${BENCH_RND_ARGS:---mode prefix --vocab 10000 --num-prefixes 800 --prefix-len 511 --suffix-len 1 --output-len 128 --num-requests 800 --concurrency 64});;
      vb) est=75; cargs=();;
      mt) est=75; cargs=(${BENCH_MT_ARGS:---mode multiturn --sessions $S --turns 6 --user-len 250 --output-len 48 --concurrency 64});;
      *) log "unknown workload $wl"; continue;;
    esac
    if [ -n "$rate" ]; then # open loop: the run lasts about (requests / rate) whatever the policy
      [ $wl = mt ] && { log "$spec: no request rate for mt"; continue; }
      local nreq=$((4 * P)); [ $wl = rnd ] && nreq=800
      est=$($PY -c "print(int($nreq / float('$rate')) + 25)") || { log "$spec: bad rate"; continue; }
      [ $wl = vb ] || cargs+=(--request-rate "$rate" --concurrency "${BENCH_OPEN_CAP:-4096}")
    fi
    if [ "$(left)" -lt $est ]; then log "$spec skipped: $(left) s left"; rec phase=routing workload=$wl policy=$pol ok=false skipped=true; continue; fi
    if [ "${pol%%:*}" = hps ]; then
      if [ $HPS_OK != 1 ]; then log "$spec skipped: no data plane"; rec phase=routing workload=$wl policy=$pol ok=false skipped=true; continue; fi
      start_hps "${pol#hps:}" "$RAW/router_${i}_$pn.log"; rrc=$?; rp=$BG
      [ $rrc = 0 ] || { log "data plane ($pol) did not start or refused the backends"; fail_tail "$RAW/router_${i}_$pn.log"; stop_tree $rp; continue; }
    else
      start_bg router "$RAW/router_${i}_$pn.log" $PY -m vllm_router.launch_router --worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002 \
        --policy "$pol" --host 127.0.0.1 --port 8000 --log-level warning --prometheus-port 29001 --worker-startup-check-interval 1
      rp=$BG
    fi
    wait_ready http://127.0.0.1:8000 $rp 60; rrc=$?
    if [ $rrc != 0 ]; then log "router ($pol) not ready: rc $rrc"; fail_tail "$RAW/router_${i}_$pn.log"; stop_tree $rp; continue; fi
    local r1 r2; r1=$(curl -s -m 30 -X POST http://127.0.0.1:8001/reset_prefix_cache); r2=$(curl -s -m 30 -X POST http://127.0.0.1:8002/reset_prefix_cache)
    $PY "$HERE/device_util.py" metrics http://127.0.0.1:8001 "$RAW/m${i}_r1_before.json" >/dev/null
    $PY "$HERE/device_util.py" metrics http://127.0.0.1:8002 "$RAW/m${i}_r2_before.json" >/dev/null
    local tl=$(( $(left) - 10 )); [ $tl -lt 30 ] && tl=30
    local cj
    if [ $wl = vb ]; then # vllm's own client (sends x-request-id per request: consistent_hash = random there)
      timeout $tl vllm bench serve --backend vllm --base-url http://127.0.0.1:8000 --endpoint /v1/completions \
        --model m --tokenizer "$MODEL" --dataset-name prefix_repetition --prefix-repetition-num-prefixes $P \
        --prefix-repetition-prefix-len 1850 --prefix-repetition-suffix-len 100 --prefix-repetition-output-len 64 \
        --num-prompts $((4 * P)) --max-concurrency 32 --ignore-eos --seed $seed --num-warmups 0 ${rate:+--request-rate $rate --max-concurrency ${BENCH_OPEN_CAP:-4096}} \
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result --result-dir "$RAW" \
        --result-filename "vb_${i}_$pn.json" > "$RAW/client_${i}.err" 2>&1
      cj=$($PY "$HERE/device_util.py" vbsum "$RAW/vb_${i}_$pn.json")
    else
      cj=$(timeout $tl $PY "$HERE/prefix_client.py" --url http://127.0.0.1:8000 --seed $seed \
        --session-header --out "$RAW/client_${i}_${tag}_$pn.json" "${cargs[@]}" 2> "$RAW/client_${i}.err" | tail -1)
    fi
    local rmj
    if [ "${pol%%:*}" = hps ]; then rmj=$(hps_metrics $i)
    else curl -s -m 10 http://127.0.0.1:29001/metrics > "$RAW/router_metrics_$i.txt"
      rmj=$($PY "$HERE/device_util.py" rmetrics "$RAW/router_metrics_$i.txt"); fi
    $PY "$HERE/device_util.py" metrics http://127.0.0.1:8001 "$RAW/m${i}_r1_after.json" >/dev/null
    $PY "$HERE/device_util.py" metrics http://127.0.0.1:8002 "$RAW/m${i}_r2_after.json" >/dev/null
    local md; md=$($PY "$HERE/device_util.py" mdiff "$RAW/m${i}_r1_before.json" "$RAW/m${i}_r1_after.json" "$RAW/m${i}_r2_before.json" "$RAW/m${i}_r2_after.json")
    [ -n "$cj" ] || { cj='{}'; log "client failed:"; tail -5 "$RAW/client_${i}.err" | tee -a "$SUM"; }
    log "$wl/$pol${rate:+ at $rate req/s} seed $seed (reset: $r1 $r2)"; log "  client: $cj"; log "  metrics: $md"; log "  router: $rmj"
    echo "$cj" | grep -q '"failed": 0,' || log "  WARNING: $wl/$pol had failed requests (or no client summary)"
    rec phase=routing workload=$wl policy=$pol seed=$seed rate=${rate:-closed} ok=true "client=$cj" "metrics=$md" "router=$rmj" kv_tokens=$K \
        "sizes={\"P\":$P,\"S\":$S}" run=$i
    stop_tree $rp; rm -f "$BENCH_DIR/pid.router"
  done
  stop_tree $p1; stop_tree $p2; rm -f "$BENCH_DIR/pid.replica1" "$BENCH_DIR/pid.replica2"
}

# ------------------------------------------------------------------ baseline
phase_baseline() { # `hpcserve baseline` on the one GPU (single node = the configured layout here)
  local snap=${BENCH_SNAP:-$(dirname "$SRC")} t0 rc folder
  ensure_model || return 1
  $PY -m pip install -q --no-deps --no-build-isolation --no-compile "$snap" > "$RAW/pip.log" 2>&1 || { log "pip install of $snap FAILED"; tail -5 "$RAW/pip.log" | tee -a "$SUM"; return 1; }
  command -v hpcserve >/dev/null || { log "no hpcserve on PATH after the install"; return 1; }
  log "hpcserve installed from $snap: $($PY -c 'import hpcserve, os; print(os.path.dirname(hpcserve.__file__))')"
  export HPCSERVE_HOME=$BENCH_DIR/hpcserve-home HPCSERVE_CACHE=$BENCH_DIR/hpcserve-cache
  HPCSERVE_API_KEY=$($PY -c 'import secrets; print(secrets.token_hex(16))'); export HPCSERVE_API_KEY
  mkdir -p "$VC/triton-pre" "$VC/inductor-pre"
  # The routing replicas' compile cache (same model folder, dtype, max-model-len): engine.env names it, which
  # hpcserve lets override its own per-layout folder (engine/replicas.py _engine_env). A miss compiles.
  cat > "$BENCH_DIR/baseline.yaml" <<YAML
# the baseline on one H200: the Llama-3.1-8B shape, dummy weights, one TP=1 replica (executor auto = uni)
name: h200-base
model: {path: $MODEL, served_name: m, dtype: bfloat16, max_model_len: 2048}
cluster: {scheduler: local, nodes: 1, gpus_per_node: 1, cpus_per_node: 16, gpu_memory_gb: 139}
parallelism: {tensor: 1, pipeline: 1, replicas: 1}
engine:
  args: ["--load-format", "dummy", "--disable-custom-all-reduce"]
  env: {NCCL_NVLS_ENABLE: "0", TORCH_SYMM_MEM_DISABLE_MULTICAST: "1", NVSHMEM_DISABLE_NVLS: "1",
        VLLM_ALLREDUCE_USE_SYMM_MEM: "0", VLLM_USE_FLASHINFER_SAMPLER: "0", VLLM_CACHE_ROOT: "$VC",
        TRITON_CACHE_DIR: "$VC/triton-pre", TORCHINDUCTOR_CACHE_DIR: "$VC/inductor-pre"}
serve: {host: 127.0.0.1, port: 8000, api_key_env: HPCSERVE_API_KEY}
results_dir: $BENCH_DIR/results
YAML
  cp "$BENCH_DIR/baseline.yaml" "$RAW/"
  gpu_free
  local args=(${BENCH_BASELINE_ARGS:---concurrency 8,32 --num-prompts 64 --input-len 512 --output-len 128})
  log "hpcserve baseline $BENCH_DIR/baseline.yaml ${args[*]} (deadline $(( $(left) - 20 )) s)"
  t0=$(now)
  timeout $(( $(left) - 20 )) hpcserve baseline "$BENCH_DIR/baseline.yaml" "${args[@]}" > "$RAW/baseline.out" 2>&1; rc=$?
  log "hpcserve baseline rc $rc after $(since "$t0") s"; tail -n 30 "$RAW/baseline.out" | cut -c1-300 | tee -a "$SUM"
  [ $rc = 0 ] || { hpcserve down h200-base >> "$RAW/down.log" 2>&1; hpcserve down h200-base-single >> "$RAW/down.log" 2>&1; }
  folder=$BENCH_DIR/results/logs/h200-base/baseline
  [ -d "$folder" ] && { tar czf "$OUT/baseline.tar.gz" -C "$folder" . ; cp "$folder/baseline.md" "$OUT/" 2>/dev/null; }
  # every run folder (timelines, states, engine and router logs: where `up`'s time went, compile cache hit/miss)
  cp -a "$BENCH_DIR/results" "$RAW/results" 2>/dev/null
  find "$BENCH_DIR/results" -path '*engines*' -name '*.log' -exec grep -H -m2 -E "Directly load|Compiling a graph|saved AOT|Compiling model again" {} + 2>/dev/null | cut -c1-240 | tee -a "$SUM"
  rec phase=baseline ok=$([ $rc = 0 ] && echo true || echo false) rc=$rc seconds=$(since "$t0") "args=${args[*]}"
}

leftovers
log "phase $PHASE (budget $BUDGET s) on $(hostname); base $BASE"
case $PHASE in
  gen) echo $$ > "$BENCH_DIR/gen.pid"; rm -f "$BENCH_DIR/gen.done"; phase_gen;;
  pyc) phase_pyc;;
  micro) phase_micro;;
  ready) phase_ready;;
  routing) phase_routing;;
  baseline) phase_baseline;;
  model) ensure_model;;
  *) log "unknown phase $PHASE";;
esac
