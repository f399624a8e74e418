#!/bin/bash
# vLLM 0.26's sleep mode on the GPU device (issue "zero": GPUs held only while they serve): cold and warm
# start of the Llama-3.1-8B shape with real weights on disk, sleep/wake level 1 (x3) and level 2, and the
# swap of two such models on one GPU under streamed load. The measuring is sleep_wake.py's (its header says
# what each phase does); this script carries vLLM there without Ray, in four calls, and starts the work.
#
# Here (once): vLLM's wheel bundle (../shared/gpu/make_bundle.sh .gpu), `echo /.zero/ >> .git/info/exclude` in
# the checkout that the device tool sends (a helper's worktree is not sent: the session's checkout is), then
#   bash benchmarks/gpu/sleep_device.sh pack .gpu CARRY     CARRY: an ignored folder of the checkout that
#        the device tool sends -> CARRY/c1..c4 (one tar of part 1's wheels and the vLLM wheel, cut in four
#        equal pieces of ~52 MiB: each call stays under 64 MiB with a 4 MB checkout) and CARRY/s (these scripts,
#        model_folder.py, pagecache.py: the checkout sent may be another branch's)
# There, back to back (the machine is given back 30 s after a call, /tmp with it), CARRY=.zero say:
#   1 carry [".zero/c1", ".zero/s"]  bash .zero/s/sleep_device.sh part 1   (stores; starts the 16 GB model
#                                     build in a session of its own: it outlives the call)
#   2 carry [".zero/c2", ".zero/s"]  bash .zero/s/sleep_device.sh part 2
#   3 carry [".zero/c3", ".zero/s"]  bash .zero/s/sleep_device.sh part 3
#   4 carry [".zero/c4", ".zero/s"]  bash .zero/s/sleep_device.sh part 4 all   (installs, then the phases)
#   5 carry [".zero/s"]              bash .zero/s/sleep_device.sh run all      (what call 4 left for time)
# Each call returns under $OUT: summary.txt, zero.json (every result so far), logs_<phase>.tar.gz.
# A dry run on CPU (no GPU, no vLLM; tiny model, stand-in servers, no install), after `pack`:
#   ZERO_W=/tmp/zdry/w ZERO_DIR=/tmp/zdry/z OUT=/tmp/zdry/o ZERO_SKIP_INSTALL=1 ZERO_VLLM="python3 $PWD/benchmarks/gpu/vllm_standin.py" \
#   ZERO_COMMON="--host 127.0.0.1" ZERO_MODEL_ARGS="--device cpu --vocab 10000 --layers 1 --hidden 64 --inter 128 --heads 2 --kv-heads 1" \
#   ZERO_LOAD_S=3 ZERO_OUT_TOKENS=64 STANDIN_DECODE_MS=20  bash CARRY/s/sleep_device.sh part N [all]   (N = 1..4)
set -uo pipefail
T_START=$(date +%s)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CMD=${1:?pack|part|run}; shift
PY=python3
W=${ZERO_W:-/tmp/w}; Z=${ZERO_DIR:-/tmp/zero}   # a dry run sets both elsewhere

case $CMD in
pack) # BUNDLE CARRY (here)
  B=${1:?bundle dir}; C=${2:?carry dir}; T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
  set -e
  cp "$B"/p1/small.tar "$T/"
  cat "$B"/p4/vllm.a "$B"/p5/vllm.b "$B"/p3/vllm.c > "$T/$(grep vllm "$B/p5/NAMES")"
  (cd "$T" && unzip -tq vllm-*.whl >/dev/null && tar cf bundle.tar small.tar vllm-*.whl)
  rm -rf "$C"/c[1-4] "$C"/s; mkdir -p "$C"/c1 "$C"/c2 "$C"/c3 "$C"/c4 "$C"/s
  split -n 4 -a 1 --numeric-suffixes=1 "$T/bundle.tar" "$T/chunk."   # 4 equal pieces of ~52 MiB
  for i in 1 2 3 4; do mv "$T/chunk.$i" "$C/c$i/"; done
  sha256sum < "$T/bundle.tar" | cut -d' ' -f1 > "$C/c4/SHA256"
  cp "$HERE"/sleep_device.sh "$HERE"/sleep_wake.py "$HERE"/device_util.py "$HERE"/model_folder.py "$HERE"/pagecache.py "$C/s/"
  du -sb "$C"/c[1-4] "$C"/s
  exit 0;;
esac

export PATH="$($PY -c 'import sys,os;print(os.path.dirname(sys.executable))'):$PATH"
export PYTHONUNBUFFERED=1
mkdir -p "$W" "$Z"; OUT=${OUT:-$Z/out}; mkdir -p "$OUT"
log() { echo "[+$(( $(date +%s) - T_START ))s] $*" | tee -a "$OUT/summary.txt"; }
base() { $PY -c "import sys; from pathlib import Path; sys.path.insert(0, '$HERE'); import sleep_wake as s; print(s.base_dir(Path('$Z')))"; }

wait_gen() { # the model build of call 1 (its own session): until it has written the index
  local m i; m=$(base)/llama8b
  for i in $(seq 240); do
    [ -f "$m/model.safetensors.index.json" ] && [ -s "$Z/gen.done" ] && break
    if [ -s "$Z/gen.pid" ] && ! kill -0 "$(cat "$Z/gen.pid")" 2>/dev/null && [ ! -s "$Z/gen.done" ]; then
      log "model build died:"; tail -5 "$Z/gen.log" | tee -a "$OUT/summary.txt"; return 1; fi
    sleep 1
  done
  log "model: $(tail -1 "$Z/gen.log" | cut -c1-400)"; du -sh "$m" | tee -a "$OUT/summary.txt"
}

run_phases() { # PHASES... [--budget S]: sleep_wake.py with what is left of this call's 10 minutes
  local left=$(( ${ZERO_CALL_S:-570} - ($(date +%s) - T_START) ))
  wait_gen || return 1
  $PY "$HERE/sleep_wake.py" "$@" --budget "$left" --dir "$Z" --out "$OUT"
}

case $CMD in
part)
  N=${1:?N}; shift
  if [ "$N" -lt 4 ]; then
    cp "$HERE/../c$N/chunk.$N" "$W/" && log "chunk $N stored ($(du -sh "$W/chunk.$N" | cut -f1))"
  fi
  if [ "$N" = 1 ]; then
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; uname -r; nproc; free -g | head -2
      df -h /tmp | tail -1; stat -f -c '/tmp: %T' /tmp
      $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    } 2>&1 | tee -a "$OUT/summary.txt"
    M=$(base)/llama8b; rm -f "$Z/gen.done"
    # the model (Llama-3.1-8B shape, 16.06 GB of random bf16 safetensors, fsync'd) in a session of its own
    setsid bash -c "$PY '$HERE/model_folder.py' '$M' --weights ${ZERO_MODEL_ARGS:-} > '$Z/gen.log' 2>&1 && echo ok > '$Z/gen.done'" < /dev/null > /dev/null 2>&1 &
    echo $! > "$Z/gen.pid"; log "model build started (pid $(cat "$Z/gen.pid")) into $M"
  fi
  if [ "$N" = 4 ]; then
    cat "$W/chunk.1" "$W/chunk.2" "$W/chunk.3" "$HERE/../c4/chunk.4" > "$W/bundle.tar" || exit 1
    [ "$(sha256sum < "$W/bundle.tar" | cut -d' ' -f1)" = "$(cat "$HERE/../c4/SHA256")" ] || { log "bundle checksum MISMATCH"; exit 1; }
    rm -f "$W"/chunk.[123]; mkdir -p "$W/b/s"; tar xf "$W/bundle.tar" -C "$W/b" && tar xf "$W/b/small.tar" -C "$W/b/s" && rm "$W/bundle.tar"
    [ -n "${ZERO_SKIP_INSTALL:-}" ] && { log "install skipped (dry run): $(ls "$W/b" | tr '\n' ' ')"; [ $# -gt 0 ] && run_phases "$@"; log done; exit; }
    ( cd "$W/b/s" && $PY -m pip install -q --no-index --find-links bk 'typing_extensions>=4.16' 'anyio>=4.10' 'packaging>=24.2' 'aiohttp>=3.13.3' \
      && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir ./*.whl \
      && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$W"/b/vllm-*.whl ) 2>&1 | grep -v -i warning | tail -5
    $PY -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 | tail -1 | tee -a "$OUT/summary.txt"
    log "installed"
    [ $# -gt 0 ] && run_phases "$@"
  fi;;
run) run_phases "$@";;
*) echo "unknown command $CMD" >&2; exit 2;;
esac
log "done"
