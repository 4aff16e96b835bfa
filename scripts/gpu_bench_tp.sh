#!/usr/bin/env bash
# Tensor parallelism on the GPUs (docs/tensor_parallel.md): `bench decode` at tensor-parallel
# size 1 and 2 side by side, a 32B-shaped model that needs two GPUs, `bench serve` at size 2.
# JSON, logs and the markdown table (tp_decode.md, from scripts/tp_decode_table.py) go to $OUT.
#
#   run(kind="nvidia-h200-x2", command="bash scripts/gpu_bench_tp.sh decode")   # tp1, tp2 and big below
#   run(kind="nvidia-h200-x2", carry=[".gpu_site"], command="bash scripts/gpu_bench_tp.sh serve")  # 24 x (1K, 10K)
#   run(kind="nvidia-h200", command="bash scripts/gpu_bench_tp.sh tp1")         # the size-1 part, on one GPU
#   run(kind="nvidia-h200-x2", command="bash scripts/gpu_bench_tp.sh tokens")  # size 2's greedy tokens = size 1's
# `tp1`, `tp2` and `big` run one part each (if `decode` does not fit one call): size 1 at batch
# 16; size 2 at batches 16 and 32; the 32B shape at size 2, batches 8 and 16. Each part is one
# process (dense and sparse side by side); every part rewrites tp_decode.md from the JSON in $OUT.
#
# Sizes change without editing: MODEL, BIG_MODEL, CONTEXT, HOST_KV_GB (the whole engine's: each
# rank pins its share), STEPS, BENCH_S (seconds per part), DECODE_EXTRA and TOKENS_EXTRA (more
# flags for the bench and the token check, e.g. a small --kv-cache-gb for a CPU smoke run).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.:.gpu_site
MODEL=${MODEL:-qwen3-8b}
BIG_MODEL=${BIG_MODEL:-qwen3-32b}
CONTEXT=${CONTEXT:-32768}
HOST_KV_GB=${HOST_KV_GB:-160}
STEPS=${STEPS:-32}
bench() {  # NAME FLAGS...: the CLI's `bench decode` without importing the rest of the CLI
  local name=$1; shift
  echo "=== $name: bench decode $*"
  timeout "${BENCH_S:-400}" python3 -c "import sys, argparse
from oasiskv.bench.decode import add_decode_args, run_decode_bench
from oasiskv.entrypoints.args import add_engine_args
p = argparse.ArgumentParser(); add_decode_args(p); add_engine_args(p)
sys.exit(run_decode_bench(p.parse_args(sys.argv[1:])))" --load-format dummy --host-kv-gb "$HOST_KV_GB" \
    --context-lens "$CONTEXT" --steps "$STEPS" --sweep ${DECODE_EXTRA:-} "$@" \
    --output-json "$OUT/decode_$name.json" 2>&1 | tee "$OUT/decode_$name.log"
}
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
free -g | head -2
part=${1:-decode}
case "$part" in
decode|tp1|tp2|big)
  case "$part" in decode|tp1) bench tp1 --model "$MODEL" --batch-sizes 16 ;; esac
  case "$part" in decode|tp2) bench tp2 --model "$MODEL" --batch-sizes 16,32 --tensor-parallel-size 2 ;; esac
  case "$part" in decode|big) bench big_tp2 --model "$BIG_MODEL" --batch-sizes 8,16 --tensor-parallel-size 2 ;; esac
  python3 scripts/tp_decode_table.py "$OUT" | tee "$OUT/tp_decode.md"
  ;;
tokens)  # float32, dense and sparse (scripts/gpu_check_tp_tokens.py)
  python3 scripts/gpu_check_tp_tokens.py --model "$MODEL" ${TOKENS_EXTRA:-} 2>&1 | tee "$OUT/tp_tokens.log" \
    | tail -1 > "$OUT/tp_tokens.json"
  cat "$OUT/tp_tokens.json"
  ;;
serve)  # the reasoning-shaped load at size 2, dense then sparse (scripts/gpu_bench_serve.sh)
  SERVE_EXTRA="-tp 2 ${SERVE_EXTRA:-}" SCENARIOS=${SCENARIOS:-r24x10k} OUT="$OUT/serve_tp2" \
    bash scripts/gpu_bench_serve.sh scenarios
  ;;
*)
  echo "usage: bash scripts/gpu_bench_tp.sh [decode|tp1|tp2|big|tokens|serve]" >&2
  exit 2
  ;;
esac
