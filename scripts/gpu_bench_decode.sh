#!/usr/bin/env bash
# Long-context decode on the GPU machine, dense against sparse (docs/benchmarks.md). JSON, logs
# and the plot go to $OUT. Runs from the source tree (the GPU machine has no pip).
#   bash scripts/gpu_bench_decode.sh b16      # batch 16 at 16K and 32K, with the foreground alone (~3 min)
#   bash scripts/gpu_bench_decode.sh full     # sweep over batch, plot, fetch-cap ablation, capacity (~3 min)
#   bash scripts/gpu_bench_decode.sh ablation # the fetch-cap ablation with the auto budget at batch 4, 16, 32 (16K)
#   bash scripts/gpu_bench_decode.sh checks   # kernel, pipeline and engine checks against their references
#   bash scripts/gpu_bench_decode.sh profile  # the 16K step kernel by kernel (scripts/gpu_profile_sparse.py)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.
bench() {  # the CLI's `bench decode` without importing the rest of the CLI (no server deps here)
  python3 -c "import sys, argparse
from oasiskv.bench.decode import add_decode_args, run_decode_bench
from oasiskv.entrypoints.args import add_engine_args
p = argparse.ArgumentParser(); add_decode_args(p); add_engine_args(p)
sys.exit(run_decode_bench(p.parse_args(sys.argv[1:])))" --model qwen3-8b --load-format dummy --host-kv-gb 92 "$@"
}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
free -g | head -2
case "${1:-b16}" in
b16)
  bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --no-prefetch-run \
    --output-json "$OUT/decode_b16.json" 2>&1 | tee "$OUT/decode_b16.log"
  ;;
full)
  bench --sweep --batch-sizes 1,4,16,32 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --fetch-ablation \
    --batch-size 16 --context-len 32768 --gpu-kv-gb 24 --output-json "$OUT/decode_full.json" \
    --plot "$OUT/decode_sweep.png" 2>&1 | tee "$OUT/decode_full.log"
  ;;
ablation)
  bench --fetch-ablation --fetch-ablation-batches 4,16,32 --context-len 16384 --steps 32 --summary-dtypes fp8 \
    --output-json "$OUT/decode_fetch_ablation.json" 2>&1 | tee "$OUT/decode_fetch_ablation.log"
  ;;
checks)
  python3 scripts/gpu_check_kernels.py --quick 2>&1 | grep -v "^PASS" | tee "$OUT/check_kernels.log"
  python3 scripts/gpu_check_sparse.py --no-sweep 2>&1 | tee "$OUT/check_sparse.log"
  python3 scripts/gpu_check_pipeline.py --json "$OUT/check_pipeline.json" 2>&1 | tee "$OUT/check_pipeline.log"
  python3 scripts/gpu_check_sparse_engine.py --dtype float32 2>&1 | tail -3 | tee "$OUT/check_sparse_engine.log"
  python3 scripts/gpu_check_sparse_engine.py --summary-dtype fp8 2>&1 | tail -3 | tee -a "$OUT/check_sparse_engine.log"
  ;;
profile)
  python3 scripts/gpu_profile_sparse.py --context 16384 --summary-dtype fp8 2>&1 | tee "$OUT/profile_16k.log"
  ;;
*)
  echo "usage: bash scripts/gpu_bench_decode.sh [b16|full|ablation|checks|profile]" >&2
  exit 2
  ;;
esac
