#!/usr/bin/env bash
# Issue 4 on one H200, in one call: pipeline checks, then `bench decode` runs, JSON and logs to $OUT.
#   usage: bash scripts/gpu_bench_decode.sh [quick|b16|summaries|epilogue|deferred|before|after|stages|bounds|merge|forks|tma|sweeps|transfer-idle|beside|company|huge-pages|mini-step|exclusive|exclusive-32k|idle-priority|whole-sm|tenth|eleventh|eleventh-32k|confirm|acceptance|acceptance-runs|full]
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.
bench() {  # the CLI's `bench decode` without importing the rest of the CLI
  python3 -c "import sys, argparse
from oasiskv.bench.decode import add_decode_args, run_decode_bench
from oasiskv.entrypoints.args import add_engine_args
p = argparse.ArgumentParser(); add_decode_args(p); add_engine_args(p)
sys.exit(run_decode_bench(p.parse_args(sys.argv[1:])))" --model qwen3-8b --load-format dummy --host-kv-gb 92 "$@"
}
profiles_16k() {  # each argument "NAME FLAGS...": one 16K profile (gpu_profile_sparse.py) with those flags
  for run in "$@"; do
    set -- $run
    name=$1; shift
    python3 scripts/gpu_profile_sparse.py --context 16384 --summary-dtype fp8 "$@" > "$OUT/profile_16k_$name.log" 2>&1
    mv "$OUT/sparse_profile.json" "$OUT/sparse_profile_16k_$name.json"
    rm -f "$OUT"/trace_*
    echo "== $name"; grep -A10 "beside them\|step_ms\|transfer busy" "$OUT/profile_16k_$name.log"
  done
}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
free -g | head -2
case "${1:-quick}" in
quick)
  [ "${CHECK:-1}" = 1 ] && python3 scripts/gpu_check_pipeline.py --json "$OUT/check_pipeline.json" 2>&1 | tee "$OUT/check_pipeline.log"
  bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --transfer-programs 8,16 --transfer-backend uva,dma --no-prefetch-run --output-json "$OUT/decode_b16.json" 2>&1 | tee "$OUT/decode_b16.log"
  ;;
b16)  # the equal-batch acceptance rows only: dense and sparse at batch 16, 16K and 32K, async scheduling off and on
  bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --async-modes off,on \
    --output-json "$OUT/decode_b16.json" 2>&1 | tee "$OUT/decode_b16.log"
  ;;
summaries)  # fp8 against KV-dtype summaries: kernel checks and timings, engine tokens, then batch 16 side by side
  python3 scripts/gpu_check_sparse.py --no-sweep 2>&1 | tee "$OUT/check_sparse.log"
  python3 scripts/gpu_check_sparse_engine.py --summary-dtype fp8 2>&1 | tail -4 | tee "$OUT/check_sparse_engine_fp8.log"
  bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes auto,fp8 \
    --output-json "$OUT/decode_b16_summaries.json" 2>&1 | tee "$OUT/decode_b16_summaries.log"
  ;;
epilogue)  # this tree against an older one ($OLD, e.g. `git archive REV oasiskv scripts`): checks, then batch 16 fp8 runs of each
  python3 scripts/gpu_check_kernels.py --quick 2>&1 | grep -v "^PASS" | tee "$OUT/check_kernels.log"
  python3 scripts/gpu_check_sparse_engine.py --summary-dtype fp8 2>&1 | tail -3 | tee "$OUT/check_sparse_engine.log"
  python3 scripts/gpu_check_sparse_engine.py --dtype float32 2>&1 | tail -3 | tee -a "$OUT/check_sparse_engine.log"
  runs="--sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --no-prefetch-run"
  (cd "$OLD" && bench $runs --output-json "$OUT/decode_b16_before.json") 2>&1 | tee "$OUT/decode_b16_before.log"
  bench $runs --bounds-tiling "${TILINGS:-auto}" --output-json "$OUT/decode_b16_after.json" 2>&1 | tee "$OUT/decode_b16_after.log"
  ;;
deferred)  # transfers of the last layers opening the next step: engine checks, then batch 16 fp8 across deferrals
  python3 scripts/gpu_check_sparse_engine.py --summary-dtype fp8 2>&1 | tail -3 | tee "$OUT/check_sparse_engine.log"
  python3 scripts/gpu_check_sparse_engine.py --dtype float32 2>&1 | tail -3 | tee -a "$OUT/check_sparse_engine.log"
  bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --no-prefetch-run \
    --deferred-layers "${DEFERRED:-0,1,2,4}" --output-json "$OUT/decode_b16_deferred.json" 2>&1 | tee "$OUT/decode_b16_deferred.log"
  ;;
before)  # checks, then batch 16 fp8 runs of an older tree ($OLD): the first half of a before / after pair
  python3 scripts/gpu_check_kernels.py --working-set 2>&1 | grep -v "^PASS" | tee "$OUT/check_kernels.log"
  python3 scripts/gpu_check_sparse_engine.py --summary-dtype fp8 2>&1 | tail -3 | tee "$OUT/check_sparse_engine.log"
  python3 scripts/gpu_check_sparse_engine.py --dtype float32 2>&1 | tail -3 | tee -a "$OUT/check_sparse_engine.log"
  (cd "$OLD" && bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 \
    --no-prefetch-run --output-json "$OUT/decode_b16_before.json") 2>&1 | tee "$OUT/decode_b16_before.log"
  ;;
after)  # the second half: this tree's batch 16 fp8 runs, across the foreground's attention splits ($SPLITS)
  bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --no-prefetch-run \
    --attention-splits "${SPLITS:-0,1,2}" --output-json "$OUT/decode_b16_after.json" 2>&1 | tee "$OUT/decode_b16_after.log"
  ;;
stages)  # the working-set attention with two K/V tiles in flight (5 stages): kernel checks, probe, batch 16 side by side
  python3 scripts/gpu_check_kernels.py --quick 2>&1 | grep -v "^PASS" | tee "$OUT/check_kernels.log"
  python3 scripts/gpu_probe_foreground.py 2>&1 | grep "^attention" | tee "$OUT/probe.log"
  bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --no-prefetch-run \
    --attention-splits 1,2 --attention-stages 3,5 --output-json "$OUT/decode_b16_stages.json" 2>&1 | tee "$OUT/decode_b16_stages.log"
  ;;
bounds)  # the bounds kernel's load stages and tile (its shared memory decides whether a GEMM's CTA fits beside it), and each stage's share (~5 min)
  bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --no-prefetch-run \
    --stage-ablation --bounds-tiling auto,64:auto:1,64:auto:2,32:auto:1,32:auto:2 \
    --output-json "$OUT/decode_b16_bounds_stages.json" 2>&1 | tee "$OUT/decode_b16_bounds_stages.log"
  ;;
merge)  # the attention's last split program merges (no merge launch; measured 2026-12-01: no gain); checks, engine tokens, batch 16 side by side (~4 min)
  python3 scripts/gpu_check_kernels.py --quick 2>&1 | grep -v "^PASS" | tee "$OUT/check_kernels.log"
  python3 scripts/gpu_check_sparse_engine.py --summary-dtype fp8 --fused-merge --attention-splits 2 2>&1 | tail -3 \
    | tee "$OUT/check_sparse_engine.log"
  python3 scripts/gpu_probe_foreground.py --batches 16 2>&1 | grep "^attention" | tee "$OUT/probe.log"
  bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --no-prefetch-run \
    --attention-splits 1,2,3 --attention-merges launch,fused --output-json "$OUT/decode_b16_merge.json" \
    2>&1 | tee "$OUT/decode_b16_merge.log"
  ;;
forks)  # where each layer's stages start (after attention / o_proj / mlp): engine tokens, then batch 16 side by side (~5 min)
  for f in o_proj mlp; do
    python3 scripts/gpu_check_sparse_engine.py --summary-dtype fp8 --stages-fork $f 2>&1 | tail -3 \
      | tee -a "$OUT/check_sparse_engine.log"
  done
  bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --no-prefetch-run \
    --attention-splits "${SPLITS:-1,2}" --stage-forks attention,o_proj,mlp --output-json "$OUT/decode_b16_forks.json" \
    2>&1 | tee "$OUT/decode_b16_forks.log"
  ;;
tma)  # measured 2026-12-01, sixth session, no gain (~4 min): the transfer through TMA: checks, alone and beside GEMMs, engine tokens, batch 16
  python3 scripts/gpu_check_transfer_tma.py --json "$OUT/check_transfer_tma.json" > "$OUT/check_transfer_tma.log" 2>&1
  grep -q "tma exact: True" "$OUT/check_transfer_tma.log" && TMA=1 || TMA=0
  grep "exact\|alone GB/s\|slowdown\|error" "$OUT/check_transfer_tma.log"
  if [ $TMA = 1 ]; then
    python3 scripts/gpu_check_sparse_engine.py --summary-dtype fp8 --transfer-tma-stages 6 2>&1 | tail -3 \
      | tee "$OUT/check_sparse_engine_tma.log"
    bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 \
      --transfer-programs 4,8 --transfer-tma-stages 0,6 --output-json "$OUT/decode_b16_tma.json" \
      2>&1 | tee "$OUT/decode_b16_tma.log"
  fi
  ;;
sweeps)  # measured 2026-12-01, sixth session, no gain (~5 min): attention stages under the fork rule, more transfer programs at 16K, bounds tilings at 32K
  bench --sweep --batch-sizes 16 --context-lens 32768,16384 --steps 32 --summary-dtypes fp8 \
    --attention-stages 3,5,3,5 --output-json "$OUT/decode_b16_stages_fork_rule.json" 2>&1 | tee "$OUT/decode_b16_stages_fork_rule.log"
  bench --sweep --batch-sizes 16 --context-lens 16384 --steps 32 --summary-dtypes fp8 \
    --transfer-programs 8,12 --gemm-sm-carveouts 8,12 --output-json "$OUT/decode_b16_transfer_carveout.json" \
    2>&1 | tee "$OUT/decode_b16_transfer_carveout.log"
  bench --sweep --batch-sizes 16 --context-lens 32768 --steps 32 --summary-dtypes fp8 \
    --bounds-tiling auto,64:auto:2,32:auto:2,auto --output-json "$OUT/decode_b16_bounds_o_proj.json" \
    2>&1 | tee "$OUT/decode_b16_bounds_o_proj.log"
  ;;
transfer-idle)  # measured 2026-12-01, seventh session (~3 min): is the 16K transfer a queue or keeping pace? Its idle time, 3 profiles
  for run in "default" "splits2 --attention-splits 2" "programs12 --transfer-programs 12"; do
    set -- $run
    name=$1; shift
    python3 scripts/gpu_profile_sparse.py --modes sparse --context 16384 --summary-dtype fp8 "$@" \
      > "$OUT/profile_16k_$name.log" 2>&1
    mv "$OUT/sparse_profile.json" "$OUT/sparse_profile_16k_$name.json"
    rm -f "$OUT"/trace_*
    echo "== $name"; grep "transfer busy\|foreground idle\|step_ms" "$OUT/profile_16k_$name.log"
  done
  ;;
beside)  # measured 2026-12-02, eighth session (~4 min): the working-set attention alone and beside five transfer variants, then at the step's footprints
  python3 scripts/gpu_probe_attention_beside.py --json "$OUT/probe_attention_beside.json" 2>&1 | tee "$OUT/probe_attention_beside.log"
  for size in "36 256" "4 1024" "36 1024"; do  # the step's footprints: 36 working sets, 64 MB host extents
    set -- $size
    python3 scripts/gpu_probe_attention_beside.py --attention-buffers $1 --blocks $2 --transfers "uva 8,hbm 8" \
      --json "$OUT/probe_attention_beside_$1_$2.json" 2>&1 | grep -v "^(" | tee "$OUT/probe_attention_beside_$1_$2.log"
  done
  [ "${STEP:-1}" = 1 ] && bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --no-prefetch-run \
    --transfer-programs 4,8 --attention-stages 3,5 --output-json "$OUT/decode_b16_beside.json" 2>&1 | tee "$OUT/decode_b16_beside.log"
  ;;
company)  # measured 2026-12-02, eighth session (~2.5 min): what runs beside the attention in the 16K step, 5 stages then 3
  profiles_16k "stages5 --modes fg,sparse --attention-stages 5" "stages3 --modes sparse"
  ;;
huge-pages)  # measured 2026-12-02, eighth session (~3 min): the host pool on 4 KiB base pages, then on 2 MiB huge pages: batch 16 fp8, a process each
  cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag
  for pages in base huge; do
    bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --host-pages $pages \
      --output-json "$OUT/decode_b16_pages_$pages.json" 2>&1 | tee "$OUT/decode_b16_pages_$pages.log"
  done
  ;;
mini-step)  # prepared in the eighth session, unmeasured (~3 min): the foreground's GEMMs and attention of 36 layers, alone and beside one step's fetch, 5 then 3 stages; then 5 beside the fetch on 4 whole SMs
  for run in "5 uva 8" "3 uva 8" "5 uva 4 w32"; do
    set -- $run
    stages=$1; shift
    name="${stages}_$(echo "$*" | tr ' ' '_')"
    python3 scripts/gpu_probe_mini_step.py --stages $stages --transfer "$*" --json "$OUT/probe_mini_step_$name.json" 2>&1 \
      | grep -v "^(" | tee "$OUT/probe_mini_step_$name.log"
    rm -f "$OUT"/trace_mini_step_*
  done
  ;;
idle-priority)  # prepared in the ninth session, unmeasured (~3 min): the 16K profile with the transfer stream at high priority, then with the exclusive fetch too: do the transfer's ~19 µs gaps a launch shrink?
  profiles_16k "high --modes sparse --transfer-priorities high" \
    "high_exclusive --modes sparse --transfer-priorities high --transfer-programs 4:16:32 --attention-stages 5"
  ;;
exclusive|exclusive-32k)  # measured 2026-12-02, tenth session (~2 and ~1 min): the fetch on 4 programs that each hold a whole SM (16 items, 32 warps) against the then default 8, 3 and 5 attention stages, the transfer stream at normal and high priority, batch 16 fp8, one process; `exclusive` first probes the attention beside both fetches at the step's footprint
  context=$([ "$1" = exclusive ] && echo 16384 || echo 32768)
  [ "$1" = exclusive ] && python3 scripts/gpu_probe_attention_beside.py --attention-buffers 36 --blocks 1024 \
    --transfers "uva 8,uva 4 w32" --json "$OUT/probe_attention_beside_exclusive.json" 2>&1 | grep -v "^(" \
    | tee "$OUT/probe_attention_beside_exclusive.log"
  bench --sweep --batch-sizes 16 --context-lens $context --steps 32 --summary-dtypes fp8 \
    --transfer-programs 8,4:16:32 --attention-stages 3,5 --transfer-priorities normal,high \
    --output-json "$OUT/decode_b16_exclusive_$context.json" 2>&1 | tee "$OUT/decode_b16_exclusive_$context.log"
  ;;
whole-sm)  # measured 2026-12-02, tenth session: the new defaults (the fetch on 4 whole SMs, 5 attention stages): engine tokens, then batch 16 around them (5 programs, GEMM carve-out 4, high priority), then the 16K profile (~3 min)
  python3 scripts/gpu_check_sparse_engine.py --summary-dtype fp8 2>&1 | tail -3 | tee "$OUT/check_sparse_engine.log"
  bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --no-prefetch-run \
    --transfer-programs auto,5:16:32 --gemm-sm-carveouts 8,4 --transfer-priorities normal,high \
    --output-json "$OUT/decode_b16_whole_sm.json" 2>&1 | tee "$OUT/decode_b16_whole_sm.log"
  profiles_16k "whole_sm --modes fg,sparse"
  ;;
tenth)  # measured 2026-12-02, tenth session (~5 min): engine tokens in fp32 and bf16 (fp8 summaries), 16K around the new defaults (the fork, deferred layers, the bounds tiling), then acceptance
  for check in "--dtype float32" "--summary-dtype fp8"; do
    python3 scripts/gpu_check_sparse_engine.py $check 2>&1 | tail -3 | tee -a "$OUT/check_sparse_engine.log"
  done
  bench --sweep --batch-sizes 16 --context-lens 16384 --steps 32 --summary-dtypes fp8 --stage-forks attention,o_proj \
    --deferred-layers 2,3 --bounds-tiling auto,64:8:3 --output-json "$OUT/decode_b16_16k_tenth.json" 2>&1 \
    | tee "$OUT/decode_b16_16k_tenth.log"
  bash "$0" acceptance-runs
  ;;
confirm)  # measured 2026-12-02, tenth session: the check of the 16K o_proj fork as the default (~5 min): engine tokens under that fork, acceptance, then batch 16 again in a process of its own
  python3 scripts/gpu_check_sparse_engine.py --summary-dtype fp8 --stages-fork o_proj 2>&1 | tail -3 | tee "$OUT/check_sparse_engine.log"
  bash "$0" acceptance-runs
  bench --sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 \
    --output-json "$OUT/decode_b16_repeat.json" 2>&1 | tee "$OUT/decode_b16_repeat.log"
  ;;
eleventh)  # measured 2026-12-02, eleventh session (~5 min): the one-warp eviction and the write-through by rows: kernel checks (ENGINE=1: engine tokens too), then batch 16 of the tree before ($OLD, e.g. `git archive 041e9ae oasiskv scripts`) and twice of this one, each its own process, then this tree's 16K profile
  stamp() { echo "== $(date +%T) $*"; }
  stamp check_pipeline; python3 scripts/gpu_check_pipeline.py --json "$OUT/check_pipeline.json" 2>&1 | tail -30 | tee -a "$OUT/eleventh.log"
  [ "${ENGINE:-0}" = 1 ] && python3 scripts/gpu_check_sparse_engine.py --summary-dtype fp8 2>&1 | tail -3 | tee -a "$OUT/eleventh.log"
  runs="--sweep --batch-sizes 16 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --no-prefetch-run"
  stamp before; (cd "$OLD" && bench $runs --output-json "$OUT/decode_b16_before.json") 2>&1 | tee -a "$OUT/eleventh.log"
  stamp after; bench $runs --output-json "$OUT/decode_b16_after.json" 2>&1 | tee -a "$OUT/eleventh.log"
  stamp again; bench $runs --output-json "$OUT/decode_b16_again.json" 2>&1 | tee -a "$OUT/eleventh.log"
  stamp profile; profiles_16k "eleventh"
  stamp done
  ;;
eleventh-32k)  # measured 2026-12-02, eleventh session (~4 min): the graph step against the in-line one, then 32K at batch 16 of the tree before ($OLD) and of this one, alternating, twice
  python3 scripts/gpu_check_pipeline.py --checks graph_step 2>&1 | grep "graph step\|error"
  runs="--sweep --batch-sizes 16 --context-lens 32768 --steps 32 --summary-dtypes fp8"
  for i in 1 2; do
    (cd "$OLD" && bench $runs --output-json "$OUT/decode_b16_32k_before_$i.json") 2>&1 | grep "^ dense\|^sparse\|x output"
    bench $runs --output-json "$OUT/decode_b16_32k_after_$i.json" 2>&1 | grep "^ dense\|^sparse\|x output"
  done
  ;;
acceptance|acceptance-runs)  # issue 4's points: engine tokens (not in acceptance-runs), batch 16 at 32K and 16K with the ablation, then capacity on its own
  [ "$1" = acceptance ] && python3 scripts/gpu_check_sparse_engine.py --summary-dtype fp8 2>&1 | tail -3 | tee "$OUT/check_sparse_engine.log"
  bench --sweep --batch-sizes 16 --context-lens 32768,16384 --steps 32 --summary-dtypes fp8 --no-prefetch-run \
    --fetch-ablation --batch-size 16 --context-len 32768 --output-json "$OUT/decode_acceptance.json" 2>&1 | tee "$OUT/decode_acceptance.log"
  bench --gpu-kv-gb 24 --context-len 32768 --steps 32 --summary-dtypes fp8 --output-json "$OUT/decode_capacity.json" \
    2>&1 | tee "$OUT/decode_capacity.log"
  ;;
full)  # sweep, fetch-cap ablation and capacity in one process (one model load, one host pool; ~2 min, measured 2026-12-02)
  bench --sweep --batch-sizes 1,4,16,32 --context-lens 16384,32768 --steps 32 --summary-dtypes fp8 --fetch-ablation \
    --batch-size 16 --context-len 32768 --gpu-kv-gb 24 --output-json "$OUT/decode_full.json" \
    --plot "$OUT/decode_sweep.png" 2>&1 | tee "$OUT/decode_full.log"
  ;;
esac
