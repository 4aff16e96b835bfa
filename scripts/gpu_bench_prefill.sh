#!/usr/bin/env bash
# Long-prompt prefill on the GPU machine: the prefill kernel against its reference at
# real shapes and timed, HF transformers' one-pass prefill, the engine's prefill tokens/s per
# chunk size and the ITL of decode rows while a 32K prompt prefills. Logs and JSON go to $OUT.
# Runs from the source tree (the GPU machine has no pip). Parts, any of them, in order:
#   bash scripts/gpu_bench_prefill.sh                 # all three (~6 min)
#   bash scripts/gpu_bench_prefill.sh kernel hf       # checks + kernel timing, HF peer (~3 min)
#   bash scripts/gpu_bench_prefill.sh engine          # 8 x 32K at 5 chunk sizes, then the ITL runs (~4 min)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
status=0
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(kernel hf engine)
for part in "${parts[@]}"; do
  case "$part" in
  kernel)
    python3 scripts/gpu_prefill_kernel.py --sweep 2>&1 | tee "$OUT/prefill_kernel.log"
    status=$((status | PIPESTATUS[0]))
    ;;
  hf)  # its own process: HF's model and the engine's do not share the GPU
    python3 scripts/gpu_bench_prefill.py --parts hf 2>&1 | tee "$OUT/prefill_hf.log"
    status=$((status | PIPESTATUS[0]))
    [ -f "$OUT/prefill_bench.json" ] && mv "$OUT/prefill_bench.json" "$OUT/prefill_hf.json"
    ;;
  engine)
    python3 scripts/gpu_bench_prefill.py --parts throughput,itl 2>&1 | tee "$OUT/prefill_engine.log"
    status=$((status | PIPESTATUS[0]))
    [ -f "$OUT/prefill_bench.json" ] && mv "$OUT/prefill_bench.json" "$OUT/prefill_engine.json"
    ;;
  *)
    echo "usage: bash scripts/gpu_bench_prefill.sh [kernel] [hf] [engine]" >&2
    exit 2
    ;;
  esac
done
exit $status
