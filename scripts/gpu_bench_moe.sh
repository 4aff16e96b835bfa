#!/usr/bin/env bash
# `qwen3-30b-a3b` (dummy weights, bf16) on one GPU, in one call per part; JSON and logs to $OUT.
#
#   run(carry=[".gpu_site"], command="bash scripts/gpu_bench_moe.sh kernels")   # after scripts/gpu_deps.sh here
#
#   kernels  the fused MoE checks and tiles against this card's measured ceilings (~2 min)
#   decode   bench decode, dense and sparse, batch 1-64 at 1K (the experts each batch routes to,
#            their bytes over the step) and capacity at 16K with KV_GB of KV state (~4 min)
#   prefill  bench throughput, 8 x 8K prompts: the active experts' FLOPs over the prefill (~2 min)
# End to end (servers, two calls back to back): MODEL=qwen3-30b-a3b KV_GB="" SCENARIOS="c32x16k"
# bash scripts/gpu_bench_serve.sh scenarios (and "r48x6k").
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.:.gpu_site
MODEL=qwen3-30b-a3b
KV_GB=${KV_GB:-12}  # about what an 80 GB card leaves beside the 30B-A3B's 61 GB of weights
cli() { python3 -m oasiskv.entrypoints.cli "$@"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
case "${1:-kernels}" in
kernels)
  python3 scripts/gpu_check_fused_moe.py 2>&1 | tee "$OUT/moe_kernels.log" ;;
decode)
  cli bench decode --model $MODEL --load-format dummy --mode both --sweep --batch-sizes 1,4,16,64 \
    --context-lens 1024 --steps 32 --kv-cache-gb "$(python3 -c "print($KV_GB + 0.5)")" --host-kv-gb 92 \
    --gpu-kv-gb "$KV_GB" --context-len 16384 --summary-dtypes fp8 --output-json "$OUT/moe_decode.json" \
    2>&1 | tee "$OUT/moe_decode.log" ;;
prefill)
  cli bench throughput --model $MODEL --load-format dummy --input-len 8192 --output-len 1 --num-prompts 8 \
    --max-model-len 8200 --kv-cache-gb 10 --output-json "$OUT/moe_prefill.json" 2>&1 | tee "$OUT/moe_prefill.log" ;;
*) echo "unknown part $1 (kernels, decode, prefill)"; exit 2 ;;
esac
