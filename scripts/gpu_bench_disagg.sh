#!/usr/bin/env bash
# Disaggregation on one H200 (docs/disaggregation.md): a prefill server and a decode server
# sharing the GPU (each with part of its memory, --kv-cache-gb), `oasiskv proxy` in front, and
# `oasiskv bench serve` through the proxy: RPF against full transfer, over NIXL's same-host path
# (UCX's default transports) and with UCX restricted to TCP, with the remote reads' byte budget
# as for a 100 and a 400 Gbit/s link. Every case starts its three processes afresh.
# Writes to $OUT: bench_<case>.json, metrics_<case>_{prefill,decode}.txt, logs, and
# disagg.json + disagg.md (scripts/disagg_table.py).
#
#   bash scripts/gpu_deps.sh && bash scripts/gpu_deps_nixl.sh     # here, once
#   run(carry=[".gpu_site", ".gpu_nixl"], command="CASES=rpf:ucx bash scripts/gpu_bench_disagg.sh")
#   python3 scripts/disagg_table.py DIR   # here, over the files of several calls gathered in DIR
#
# CASES: mode:transport[:gbps] each (mode rpf|full, transport ucx|tcp|socket, gbps the link the
# decode side's read budget stands for). One call must end within 10 minutes; at the full sizes
# give it one case, or lower PROMPTS / OUT_LEN to fit several.
# Sizes: MODEL (qwen3-8b), PROMPTS (16), IN (32768), OUT_LEN (1024), TOPK (128), BENCH_S (per case);
# EXTRA: more flags for both servers (e.g. --max-num-seqs 16: fewer captured steps); DECODE_EXTRA:
# for the decode server (e.g. --rpf-want-per-head 0).
# Memory: at 32K tokens one qwen3-8b request's KV is 4.6 GiB. The prefill's host pool holds every
# RPF request's KV until its decode ends (PREFILL_HOST_GB, default PROMPTS x 4.7 + 2 for rpf, 24 for
# full, which holds a request's KV only until the decode side has read it); the decode side's arena (DECODE_REMOTE_GB) is touched and pinned only as blocks arrive. 16 prompts in
# rpf need about 80 GiB of pinned host memory on the prefill side: the 1-GPU host has 125 GiB.
# `CASES=... bash scripts/gpu_bench_disagg.sh smoke` runs on CPU at tiny sizes (the default model).
set -u
export OASISKV_DISAGG_SECRET=${OASISKV_DISAGG_SECRET:-bench-disagg-secret}  # the roles and the proxy share it
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.:.gpu_site
if [ -f .gpu_nixl/nixl_cu13.zip ]; then
  NIXL_DIR=$(mktemp -d)
  python3 -m zipfile -e .gpu_nixl/nixl_cu13.zip "$NIXL_DIR" && export PYTHONPATH=$PYTHONPATH:$NIXL_DIR
fi
PY=${PY:-python3}
MODEL=${MODEL:-qwen3-8b}
PROMPTS=${PROMPTS:-16}
IN=${IN:-32768}
OUT_LEN=${OUT_LEN:-1024}
TOPK=${TOPK:-128}
BENCH_S=${BENCH_S:-420}
P_PORT=8100; D_PORT=8200; X_PORT=8000
ENGINE=(--model "$MODEL" --load-format dummy --top-k-blocks "$TOPK" --max-model-len $((IN + OUT_LEN + 64))
        --disable-log-stats ${EXTRA:-})
P_FLAGS=(--kv-cache-gb "${PREFILL_KV_GB:-40}")
# The decode server's pipeline keeps summaries and an item map on the GPU for --max-num-seqs
# requests of --max-model-len (5 GiB at 16 x 33K for qwen3-8b): size it to the prompts.
D_FLAGS=(--kv-cache-gb "${DECODE_KV_GB:-20}" --host-kv-gb 1 --max-num-seqs "$PROMPTS")
if [ "${1:-}" = smoke ]; then  # CPU, the default model, tiny sizes: checks the script, not speed
  export PYTHONPATH=.  # .gpu_site holds the GPU machine's Python 3.12 builds
  PY=${PY_SMOKE:-.venv/bin/python}; PROMPTS=${PROMPTS_SMOKE:-2}; IN=600; OUT_LEN=8; TOPK=4; MODEL=SmolLM2-135M
  ENGINE=(--top-k-blocks "$TOPK" --max-model-len 1000 --disable-log-stats)
  P_FLAGS=(--kv-cache-gb 0.2); D_FLAGS=(--kv-cache-gb 0.2 --host-kv-gb 0.2)
  BENCH_S=300
fi
GIB_PER_REQ=$($PY -c "print(round(($IN + $OUT_LEN) * 36 * 8 * 128 * 4 / 2**30, 2))")
SERVE=(-m oasiskv.entrypoints.cli serve)
BENCH_PY='import argparse, sys
from oasiskv.bench.serve import add_bench_serve_args, run_bench_serve
p = argparse.ArgumentParser(); add_bench_serve_args(p)
sys.exit(run_bench_serve(p.parse_args(sys.argv[1:])))'

health() {  # PID PORT: wait up to 5 minutes; give up as soon as the process is gone
  for _ in $(seq 300); do
    kill -0 "$1" 2>/dev/null || return 1
    $PY -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
      "http://127.0.0.1:$2/health" 2>/dev/null && return 0
    sleep 1
  done
  return 1
}
scrape() { $PY -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
  "http://127.0.0.1:$1/metrics" > "$2" 2>/dev/null; }
stop() { for pid in "$@"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "$@"; do for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done; }

tcp_tls() {  # the first UCX transport list without shared memory or cross-memory attach that NIXL runs on
  for tls in tcp "tcp,self" "tcp,cuda_copy" "tcp,self,cuda_copy"; do
    if UCX_TLS=$tls timeout 60 $PY -m oasiskv.disagg.bench --transport nixl --reads 256 --repeat 2 \
        > "$OUT/ucx_tls_probe.log" 2>&1; then echo "$tls"; return 0; fi
  done
  return 1
}

run_case() {  # mode:transport[:gbps]
  local case=$1 mode transport gbps name
  IFS=: read -r mode transport gbps <<< "$case"
  name=${mode}_${transport}${gbps:+_${gbps}g}
  local kt=nixl env=()
  [ "$transport" = socket ] && kt=socket
  if [ "$transport" = tcp ]; then
    [ -n "${TCP_TLS:-}" ] || TCP_TLS=$(tcp_tls) || { echo "no TCP-only UCX transport list works"; return 1; }
    env=(UCX_TLS="$TCP_TLS")
  fi
  local host_gb=${PREFILL_HOST_GB:-$($PY -c "print($PROMPTS * ($GIB_PER_REQ + 0.1) + 2 if '$mode' == 'rpf' else 24)")}
  # rpf: the decode arena holds RPF_ARENA (0.4) of the prompts' KV and gives back the earliest read
  # blocks when full; full: all of it. Both servers' pinned memory stays within ~112 GiB of the 125.
  local remote_gb=${DECODE_REMOTE_GB:-$($PY -c "print(round(min($PROMPTS * ($GIB_PER_REQ + 0.1) \
    * (${RPF_ARENA:-0.4} if '$mode' == 'rpf' else 1) + 2, 112 - $host_gb), 1))")}
  if [ "${SMOKE:-}" = 1 ]; then host_gb=0.3; remote_gb=0.3; fi
  echo "=== $name: prefill host pool $host_gb GiB, decode arena $remote_gb GiB ${env[*]}"
  local t0=$SECONDS
  env "${env[@]}" $PY "${SERVE[@]}" "${ENGINE[@]}" "${P_FLAGS[@]}" --host-kv-gb "$host_gb" --role prefill \
    --kv-transfer-mode "$mode" --kv-transport "$kt" --port $P_PORT > "$OUT/server_${name}_prefill.log" 2>&1 &
  local ppid=$!
  env "${env[@]}" $PY "${SERVE[@]}" "${ENGINE[@]}" "${D_FLAGS[@]}" --remote-kv-gb "$remote_gb" --role decode --prefill-peers http://127.0.0.1:$P_PORT \
    --kv-transport "$kt" ${gbps:+--rpf-link-gbps "$gbps"} ${DECODE_EXTRA:-} --port $D_PORT > "$OUT/server_${name}_decode.log" 2>&1 &
  local dpid=$!
  $PY -m oasiskv.entrypoints.cli proxy --prefill http://127.0.0.1:$P_PORT --decode http://127.0.0.1:$D_PORT \
    --port $X_PORT --log-level warning > "$OUT/proxy_${name}.log" 2>&1 &
  local xpid=$!
  if ! health $ppid $P_PORT || ! health $dpid $D_PORT || ! health $xpid $X_PORT; then
    echo "a server failed to start"
    for f in "$OUT"/server_"${name}"_*.log; do tail -n 20 "$f"; done
    stop $xpid $dpid $ppid; return 1
  fi
  echo "ready after $((SECONDS - t0)) s"
  timeout "$BENCH_S" $PY -c "$BENCH_PY" --port $X_PORT --num-prompts "$PROMPTS" --random-input-len "$IN" \
    --random-output-len "$OUT_LEN" --request-rate inf --ignore-eos \
    --result-dir "$OUT" --result-filename "bench_$name.json" > "$OUT/bench_$name.log" 2>&1
  grep -E "Successful|Failed|Output token throughput|Mean TTFT|Median TTFT|Median TPOT" "$OUT/bench_$name.log"
  scrape $P_PORT "$OUT/metrics_${name}_prefill.txt"
  scrape $D_PORT "$OUT/metrics_${name}_decode.txt"
  stop $xpid $dpid $ppid
  echo "case done after $((SECONDS - t0)) s"
}

[ "${1:-}" = smoke ] && SMOKE=1
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
for case in ${CASES:-rpf:ucx}; do run_case "$case"; done
$PY scripts/disagg_table.py "$OUT" --model "$MODEL" --prompts "$PROMPTS" --input-len "$IN" --output-len "$OUT_LEN" \
  --top-k "$TOPK" ${TCP_TLS:+--tcp-tls "$TCP_TLS"}
# Only a few files come back from the GPU machine: everything else in one archive.
ARCHIVE=$(mktemp -u /tmp/disagg_files.XXXX.tgz)
(cd "$OUT" && tar czf "$ARCHIVE" --exclude disagg.json --exclude disagg.md . \
  && find . -type f ! -name disagg.json ! -name disagg.md -delete && mv "$ARCHIVE" disagg_files.tgz)
