#!/usr/bin/env bash
# `oasiskv bench serve` on one H200, in one call (5-8 minutes): a dense server, then a sparse one,
# each started, loaded with random token-id prompts, scraped (/metrics) and stopped with SIGTERM.
# JSON results, bench output and server logs go to $OUT.
#
#   run(carry=[".gpu_site"], command="bash scripts/gpu_bench_serve.sh")   # after scripts/gpu_deps.sh here
#
# Sizes can be changed without editing: MODEL, DENSE_PROMPTS, DENSE_IN, DENSE_OUT, SPARSE_PROMPTS,
# SPARSE_IN, SPARSE_OUT, HOST_KV_GB, SERVE_EXTRA (more server flags), BENCH_S (seconds per bench),
# CASES (default "dense sparse"). The defaults ran in 154 s in all (2026-11-29).
# `scenarios` as the first argument runs the scenario table instead (below: SCENARIOS, KV_GB).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.:.gpu_site
PORT=${PORT:-8000}
MODEL=${MODEL:-qwen3-8b}
BENCH_S=${BENCH_S:-200}  # per bench; with two server starts the worst case stays under 10 minutes
# `oasiskv serve` and `oasiskv bench serve`, without importing every other subcommand of the CLI
# (`python3 -m oasiskv.entrypoints.cli serve ...` runs the same server).
SERVE_PY='import argparse, sys
from oasiskv.entrypoints.args import add_engine_args
from oasiskv.entrypoints.openai.cli_args import add_server_args
from oasiskv.entrypoints.openai.api_server import run_server
p = argparse.ArgumentParser(); add_server_args(p); add_engine_args(p)
sys.exit(run_server(p.parse_args(sys.argv[1:])))'
BENCH_PY='import argparse, sys
from oasiskv.bench.serve import add_bench_serve_args, run_bench_serve
p = argparse.ArgumentParser(); add_bench_serve_args(p)
sys.exit(run_bench_serve(p.parse_args(sys.argv[1:])))'

health() {  # PID [PORT]: wait up to 4 minutes for /health; give up as soon as the server process is gone
  local pid=$1 port=${2:-$PORT}
  for _ in $(seq 240); do
    kill -0 "$pid" 2>/dev/null || return 1
    python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
      "http://127.0.0.1:$port/health" 2>/dev/null && return 0
    sleep 1
  done
  return 1
}

scrape() {  # FILE [PORT]: /metrics -> file
  python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
    "http://127.0.0.1:${2:-$PORT}/metrics" > "$1" 2>/dev/null
}

stop() {  # SIGTERM, then SIGKILL after 30 s
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill -KILL "$1" 2>/dev/null
  wait "$1" 2>/dev/null
}

# run_case NAME SERVER-FLAGS... -- BENCH-FLAGS...
run_case() {
  local name=$1; shift
  local flags=()
  while [ "$1" != "--" ]; do flags+=("$1"); shift; done
  shift
  echo "=== $name: serve ${flags[*]}"
  local t0=$SECONDS
  python3 -c "$SERVE_PY" --model "$MODEL" --load-format dummy --port "$PORT" ${SERVE_EXTRA:-} "${flags[@]}" \
    > "$OUT/server_$name.log" 2>&1 &
  local pid=$!
  if ! health "$pid"; then
    echo "server failed to start; log tail:"; tail -30 "$OUT/server_$name.log"; stop "$pid"; return 1
  fi
  echo "ready after $((SECONDS - t0)) s"
  timeout "$BENCH_S" python3 -c "$BENCH_PY" --port "$PORT" "$@" \
    --result-dir "$OUT" --result-filename "bench_serve_$name.json" 2>&1 | tee "$OUT/bench_$name.log"
  scrape "$OUT/metrics_$name.txt"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee -a "$OUT/bench_$name.log"
  stop "$pid"
  echo "server exit code: $? (after $((SECONDS - t0)) s)"
  tail -5 "$OUT/server_$name.log"
}

# `bash scripts/gpu_bench_serve.sh scenarios`: the scenario table (docs/benchmarks.md). A dense
# server and a sparse server, each started once and loaded with every scenario named in
# SCENARIOS, in order, the dense one first (CASES=sparse: the sparse one alone); both with the
# same flags (--kv-cache-gb $KV_GB, "" = no limit) and the same bench. Where two servers with the
# limit fit the GPU (an H200) both start together (ports PORT and PORT+1) and only the benches
# take turns; otherwise one at a time.
# Writes bench_serve_<scenario>_<dense|sparse>.json, then scenarios.json and scenarios.md
# (scripts/scenario_table.py). One call cannot hold them all: SCENARIOS picks.
# SPARSE_EXTRA: more flags for the sparse server alone (an A/B in one call: a second run of the
# script with OUT=$OUT/b CASES=sparse SPARSE_EXTRA="--summary-dtype kv").
#   r48x6k: 48 x (1K in, 6K out)   r24x10k: 24 x (1K, 10K)   r16x16k: 16 x (1K, 16K)
#   l16x16k: 16 x (16K in, 512 out)   l8x32k: 8 x (32K in, 1K out)
#   For MODEL=qwen3-32b on one card (KV_GB="": each server takes what the card leaves):
#   m12x4k: 12 x (4K in, 2K out)   m16x8k: 16 x (8K in, 2K out)   m4x36k: 4 x (36K in, 512 out)
#   c36x16k: 36 x (16K in, 1K out)   c32x16k: 32 x (16K in, 1K out) (MODEL=qwen3-30b-a3b, KV_GB="")
scenario_load() {  # name -> "prompts input output"
  case $1 in
    r48x6k) echo "48 1024 6144" ;; r24x10k) echo "24 1024 10240" ;; r16x16k) echo "16 1024 16384" ;;
    l16x16k) echo "16 16384 512" ;; l8x32k) echo "8 32768 1024" ;;
    m12x4k) echo "12 4096 2048" ;; m16x8k) echo "16 8192 2048" ;; m4x36k) echo "4 36864 512" ;; c36x16k) echo "36 16384 1024" ;; c32x16k) echo "32 16384 1024" ;; *) echo "unknown scenario $1" >&2; return 1 ;;
  esac
}

start_scenario_server() {  # CASE PORT SERVER-FLAGS...: start it in the background; its pid -> $server_pid
  local case=$1 port=$2; shift 2
  local limit=()
  [ -n "${KV_GB-24}" ] && limit=(--kv-cache-gb "${KV_GB-24}")
  echo "=== $case: serve --port $port ${limit[*]} --max-num-seqs 64 $*"
  python3 -c "$SERVE_PY" --model "$MODEL" --load-format dummy --port "$port" "${limit[@]}" --max-num-seqs 64 \
    ${SERVE_EXTRA:-} "$@" > "$OUT/server_$case.log" 2>&1 &
  server_pid=$!
}

wait_scenario_server() {  # CASE PID PORT T0
  if ! health "$2" "$3"; then
    echo "$1 server failed to start; log tail:"; tail -30 "$OUT/server_$1.log"; stop "$2"; return 1
  fi
  echo "$1 ready after $((SECONDS - $4)) s"
}

bench_scenarios() {  # CASE PID PORT T0: every scenario's bench against the server, then stop it
  local case=$1 pid=$2 port=$3 t0=$4
  for name in ${SCENARIOS:-r24x10k}; do
    read -r n in out < <(scenario_load "$name") || continue
    echo "--- $name ($case): $n x ($in in, $out out)"
    timeout "$BENCH_S" python3 -c "$BENCH_PY" --port "$port" --num-prompts "$n" --random-input-len "$in" \
      --random-output-len "$out" --request-rate inf --ignore-eos \
      --result-dir "$OUT" --result-filename "bench_serve_${name}_$case.json" > "$OUT/bench_${name}_$case.log" 2>&1
    grep -E "Output token throughput|Median TPOT|Median ITL|Stall /|per request \(GB\)|Preemptions|Conversions" \
      "$OUT/bench_${name}_$case.log"
  done
  scrape "$OUT/metrics_$case.txt" "$port"
  stop "$pid"
  echo "$case server stopped after $((SECONDS - t0)) s"
}

if [ "${1:-}" = scenarios ]; then
  BENCH_S=${BENCH_S:-400}
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  cases=" ${CASES:-dense sparse} "
  sparse_flags=(--sparse --host-kv-gb "${HOST_KV_GB:-92}" ${SPARSE_EXTRA:-})
  t0=$SECONDS
  # Each server holds its KV limit plus its weights and workspace: ~32 GiB for the 8B, ~70 for the
  # 32B and the 30B-A3B.
  gpu_gib=$(( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) / 1024 ))
  case $MODEL in *32b*|*30b*) beside=70 ;; *) beside=32 ;; esac
  kv_gib=${KV_GB-24}
  if [ -n "$kv_gib" ] && [ "$cases" = " dense sparse " ] && (( gpu_gib >= 2 * (${kv_gib%.*} + beside) )); then
    # Both fit the GPU at once: start them together (the loads, captures and warm-ups overlap),
    # then bench one at a time; an idle server does no GPU work.
    start_scenario_server dense "$PORT"; dense_pid=$server_pid
    start_scenario_server sparse "$((PORT + 1))" "${sparse_flags[@]}"; sparse_pid=$server_pid
    wait_scenario_server dense "$dense_pid" "$PORT" "$t0" \
      && wait_scenario_server sparse "$sparse_pid" "$((PORT + 1))" "$t0" \
      && bench_scenarios dense "$dense_pid" "$PORT" "$t0" \
      && bench_scenarios sparse "$sparse_pid" "$((PORT + 1))" "$t0"
    stop "$dense_pid"; stop "$sparse_pid"
  else
    case $cases in *" dense "*)
      start_scenario_server dense "$PORT"
      wait_scenario_server dense "$server_pid" "$PORT" "$t0" && bench_scenarios dense "$server_pid" "$PORT" "$t0" ;; esac
    case $cases in *" sparse "*)
      t0=$SECONDS
      start_scenario_server sparse "$PORT" "${sparse_flags[@]}"
      wait_scenario_server sparse "$server_pid" "$PORT" "$t0" && bench_scenarios sparse "$server_pid" "$PORT" "$t0" ;; esac
  fi
  python3 scripts/scenario_table.py "$OUT" --kv-cache-gb "${KV_GB-24}" --scenarios ${SCENARIOS:-r24x10k}
  # The device tool returns at most 8 files: everything goes back as one archive, the table beside it.
  tar czf /tmp/scenario_files.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/scenario_files.tgz "$OUT/" \
    && tar xzf "$OUT/scenario_files.tgz" -C "$OUT" ./scenarios.md ./scenarios.json
  exit 0
fi

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
free -g | head -2
case " ${CASES:-dense sparse} " in *" dense "*)
run_case dense -- \
  --num-prompts "${DENSE_PROMPTS:-200}" --random-input-len "${DENSE_IN:-1024}" \
  --random-output-len "${DENSE_OUT:-256}" --request-rate inf --ignore-eos ;; esac
case " ${CASES:-dense sparse} " in *" sparse "*)
run_case sparse --sparse --sparse-threshold 4096 --host-kv-gb "${HOST_KV_GB:-48}" -- \
  --num-prompts "${SPARSE_PROMPTS:-16}" --random-input-len "${SPARSE_IN:-16384}" \
  --random-output-len "${SPARSE_OUT:-128}" --request-rate inf --ignore-eos ;; esac
ls -l "$OUT"
