#!/usr/bin/env bash
# `oasiskv bench prefix` on one H200, one call a load (LOADS=shared-doc CASE_S=170, then
# LOADS=multi-turn CASE_S=200: both together pass a call's 10 minutes): prefix cache off, then on, for
# the shared-document load (32 requests x (16K shared document + 256 own question) -> 256 out) and
# the multi-turn load (16 conversations x 4 turns: a 13K document and a 256-token question, each
# later turn re-sending the history with a new question, to ~15K), dense, then sparse; qwen3-8b
# with dummy weights. The sparse case runs with a GPU pool of SPARSE_KV_GB (12 GiB, ~85K tokens)
# against ~250K tokens of conversation history, so that a later turn finds its history evicted
# from GPU pages and loads it from the host tier (a converted request's finished extent).
# Writes prefix_<dense|sparse>.json and .log to $OUT.
#
#   run(command="LOADS=shared-doc CASE_S=170 bash scripts/gpu_bench_prefix.sh")
#   run(command="LOADS=multi-turn CASE_S=200 bash scripts/gpu_bench_prefix.sh")
#
# Sizes without editing: MODEL, LOAD_FORMAT, N, DOC, Q, O, CONV, TURNS, FIRST, MAX_LEN, HOST_KV_GB, SPARSE_KV_GB,
# LOADS (default "shared-doc multi-turn"), CASES (default "dense sparse"), CASE_S (seconds per
# case), CONTROL_CHUNK (a last cache-off run with prefill chunks of this many tokens: do tokens
# move with the chunking alone?), EXTRA (more engine flags). A check on
# CPU with the default model:
#   MODEL= LOAD_FORMAT=auto N=3 DOC=80 Q=8 O=4 CONV=2 TURNS=3 FIRST=80 MAX_LEN=256 HOST_KV_GB=0.05 \
#     SPARSE_KV_GB=0.009 EXTRA="--sparse-threshold 80 --top-k-blocks 2 --window-blocks 2" \
#     PYTHON=.venv/bin/python bash scripts/gpu_bench_prefix.sh
# (its sparse multi-turn run, 13 GPU pages, loads later turns' history from the host tier)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.
PY=${PYTHON:-python3}
# `oasiskv bench prefix` without importing every other subcommand of the CLI.
BENCH_PY='import argparse, sys
from oasiskv.bench.prefix import add_prefix_args, run_prefix_bench
from oasiskv.entrypoints.args import add_engine_args
p = argparse.ArgumentParser(); add_prefix_args(p); add_engine_args(p)
sys.exit(run_prefix_bench(p.parse_args(sys.argv[1:])))'
model=()
[ -n "${MODEL-qwen3-8b}" ] && model=(--model "${MODEL-qwen3-8b}")

run_case() {  # NAME ENGINE-FLAGS...
  local name=$1; shift
  echo "=== $name"
  local t0=$SECONDS
  # shellcheck disable=SC2086  # LOADS and EXTRA are lists
  timeout "${CASE_S:-280}" "$PY" -c "$BENCH_PY" "${model[@]}" --load-format "${LOAD_FORMAT:-dummy}" \
    --max-model-len "${MAX_LEN:-20480}" --max-num-seqs 32 \
    --num-requests "${N:-32}" --doc-len "${DOC:-16384}" --question-len "${Q:-256}" --output-len "${O:-256}" \
    --conversations "${CONV:-16}" --turns "${TURNS:-4}" --first-turn-len "${FIRST:-13312}" \
    --loads ${LOADS:-shared-doc multi-turn} ${CONTROL_CHUNK:+--control-chunk "$CONTROL_CHUNK"} ${EXTRA:-} "$@" --output-json "$OUT/prefix_$name.json" > "$OUT/prefix_$name.log" 2>&1
  echo "exit $? after $((SECONDS - t0)) s"
  grep -E "=====|Mean TTFT|Output token|hit rate|Prefill tokens|TTFT, cache|throughput, on|cache-off tokens|Preemptions" \
    "$OUT/prefix_$name.log"
}

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
case " ${CASES:-dense sparse} " in *" dense "*) run_case dense ;; esac
case " ${CASES:-dense sparse} " in *" sparse "*) run_case sparse --sparse --host-kv-gb "${HOST_KV_GB:-84}" \
  --kv-cache-gb "${SPARSE_KV_GB:-12}" ;; esac
ls -l "$OUT"
