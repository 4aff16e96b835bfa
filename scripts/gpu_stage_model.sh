#!/usr/bin/env bash
# The default model's GGUF (98 MB) on the GPU machine, which takes at most 64 MiB a run and keeps
# ignored files only while it stays warm (~30 s between runs): two halves over two back-to-back
# runs, joined and checked there, then the real-weights check (scripts/gpu_real_weights.py) and a
# small `bench serve --dataset-name text` against a dense and a sparse server on those weights.
#
#   bash scripts/gpu_stage_model.sh split     # here: .gpu_stage/part1, part2, its sha256 and the
#                                             # CPU in-line path's tokens (a few minutes)
#   run(carry=[".gpu_stage/part1"], command="bash scripts/gpu_stage_model.sh receive")
#   run(carry=[".gpu_stage/part2", ".gpu_stage/part2.sha256", ".gpu_stage/expected.json", ".gpu_site"],
#       command="bash scripts/gpu_stage_model.sh check")   # at once; `receive` again if part1 was gone
#
# PARTS picks what `check` runs (default "weights serve"): weights = gpu_real_weights.py check,
# serve = the real-text bench serve, dense then sparse (up to 8 minutes), disagg = the
# disaggregated pipeline's GPU checks (scripts/gpu_check_disagg_pipeline.py, ~3 minutes), which
# need the default model: the staged file stands in for it (OASISKV_DEFAULT_GGUF).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=.gpu_stage
case "${1:-}" in
split)
  PY=${PYTHON:-.venv/bin/python}
  gguf=$("$PY" -c "from oasiskv.models.loader import default_model_path; print(default_model_path())")
  mkdir -p "$STAGE"
  size=$(stat -c %s "$gguf")
  half=$(( (size + 1) / 2 ))
  head -c "$half" "$gguf" > "$STAGE/part1"
  tail -c +$(( half + 1 )) "$gguf" > "$STAGE/part2"
  sha256sum "$gguf" | cut -d' ' -f1 > "$STAGE/part2.sha256"  # travels with part2
  "$PY" scripts/gpu_real_weights.py record --output "$STAGE/expected.json"
  ls -l "$STAGE"
  ;;
receive)
  ls -l "$STAGE"
  ;;
check)
  [ -f "$STAGE/part1" ] || { echo "part1 is gone (the machine went cold): run receive again" >&2; exit 3; }
  OUT=${OUT:-out}
  mkdir -p "$OUT"
  cat "$STAGE/part1" "$STAGE/part2" > "$STAGE/model.gguf"
  got=$(sha256sum "$STAGE/model.gguf" | cut -d' ' -f1)
  [ "$got" = "$(cat "$STAGE/part2.sha256")" ] || { echo "sha256 mismatch: $got" >&2; exit 4; }
  echo "model.gguf assembled, sha256 $got"
  PARTS=${PARTS:-weights serve}
  export OASISKV_CACHE_DIR=$PWD/$STAGE/cache PYTHONPATH=.:.gpu_site OASISKV_DEFAULT_GGUF=$PWD/$STAGE/model.gguf
  case " $PARTS " in *" disagg "*)
    timeout 300 python3 scripts/gpu_check_disagg_pipeline.py --json "$OUT/disagg_pipeline.json" \
      2>&1 | tee "$OUT/disagg_pipeline.log" | tail -30 ;;
  esac
  case " $PARTS " in *" weights "*)
    python3 scripts/gpu_real_weights.py check --gguf "$STAGE/model.gguf" --expected "$STAGE/expected.json" \
      --output "$OUT/real_weights.json" 2>&1 | tee "$OUT/real_weights.log" ;;
  esac
  case " $PARTS " in *" serve "*) ;; *) exit 0 ;; esac
  # A small `bench serve` on real text, dense then sparse, each server started by the bench.
  for mode in dense sparse; do
    flags="--model $STAGE/model.gguf --max-model-len 8192 --log-level warning"
    [ "$mode" = sparse ] && flags="$flags --sparse --sparse-threshold 1024 --top-k-blocks 32 --host-kv-gb 16"
    timeout 240 python3 -m oasiskv.entrypoints.cli \
      bench serve --server-args "$flags" --port 8000 --dataset-name text --num-prompts "${PROMPTS:-32}" \
      --random-input-len "${IN:-3500}" --random-output-len "${OUT_LEN:-256}" --ignore-eos \
      --result-dir "$OUT" --result-filename "serve_real_text_$mode.json" 2>&1 | tee "$OUT/serve_real_text_$mode.log" \
      | grep -E "Successful|Output token|Mean TTFT|Median TPOT|hit rate|Draft acceptance|Sparse requests" \
      || echo "bench serve ($mode) printed no result: see serve_real_text_$mode.log"  # the next mode still runs
  done
  ;;
*)
  echo "usage: bash scripts/gpu_stage_model.sh split|receive|check" >&2
  exit 2
  ;;
esac
