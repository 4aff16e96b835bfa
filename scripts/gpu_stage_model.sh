#!/usr/bin/env bash
# A model's GGUF on the GPU machine, which takes at most 64 MiB a run and keeps ignored files
# only while it stays warm (~30 s between runs): N parts over N back-to-back runs, joined and
# checked there. Then, by PARTS: the real-weights check (scripts/gpu_real_weights.py), a small
# `bench serve --dataset-name text` against a dense and a sparse server on those weights, the
# disaggregated pipeline's checks, or the accuracy evaluations at 32K.
#
# The default model (98 MB, two parts):
#   bash scripts/gpu_stage_model.sh split     # here: .gpu_stage/part1, part2, model.sha256 and the
#                                             # CPU in-line path's tokens (a few minutes)
#   run(carry=[".gpu_stage/part1"], command="bash scripts/gpu_stage_model.sh receive")
#   run(carry=[".gpu_stage/part2", ".gpu_stage/model.sha256", ".gpu_stage/expected.json", ".gpu_site"],
#       command="bash scripts/gpu_stage_model.sh check")   # at once; `receive` again if a part was gone
# Qwen2.5-Coder-0.5B (491 MB, eight parts; `oasiskv download qwen2.5-coder-0.5b` first):
#   STAGE_GGUF=$(ls ~/.cache/oasiskv/qwen2.5-coder-0.5b/*.gguf) STAGE_PARTS=8 bash scripts/gpu_stage_model.sh split
#   run(carry=[".gpu_stage/part1"], command="bash scripts/gpu_stage_model.sh receive")   # ... part7
#   run(carry=[".gpu_stage/part8", ".gpu_stage/model.sha256"],
#       command="PARTS=accuracy bash scripts/gpu_stage_model.sh check")
#
# PARTS picks what `check` runs (default "weights serve"): weights = gpu_real_weights.py check
# (the default model), serve = the real-text bench serve, dense then sparse (up to 8 minutes),
# disagg = the disaggregated pipeline's GPU checks (scripts/gpu_check_disagg_pipeline.py, ~3
# minutes), which need the default model: the staged file stands in for it (OASISKV_DEFAULT_GGUF);
# accuracy = passkey (one and four keys) and fidelity at 32K tokens, dense against sparse at
# K = 128 and 32, float32 on the GPU (for a 32K-context model).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=.gpu_stage
case "${1:-}" in
split)
  PY=${PYTHON:-.venv/bin/python}
  gguf=${STAGE_GGUF:-$("$PY" -c "from oasiskv.models.loader import default_model_path; print(default_model_path())")}
  n=${STAGE_PARTS:-2}
  rm -rf "$STAGE"
  mkdir -p "$STAGE"
  split -n "$n" -a 1 --numeric-suffixes=1 "$gguf" "$STAGE/part"  # part1 .. partN, in order
  sha256sum "$gguf" | cut -d' ' -f1 > "$STAGE/model.sha256"  # travels with the last part
  echo "$n" > "$STAGE/parts"
  [ -z "${STAGE_GGUF:-}" ] && "$PY" scripts/gpu_real_weights.py record --output "$STAGE/expected.json"
  ls -l "$STAGE"
  ;;
receive)
  ls -l "$STAGE"
  ;;
check)
  parts=$(ls "$STAGE"/part[0-9]* | sort -V)
  echo "parts here:" $parts
  OUT=${OUT:-out}
  mkdir -p "$OUT"
  cat $parts > "$STAGE/model.gguf"
  got=$(sha256sum "$STAGE/model.gguf" | cut -d' ' -f1)
  [ "$got" = "$(cat "$STAGE/model.sha256")" ] || {
    echo "sha256 mismatch ($got): a part is missing (the machine went cold?): receive them again" >&2; exit 4; }
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
  case " $PARTS " in *" accuracy "*)
    eval_flags=(--model "$STAGE/model.gguf" --device cuda --dtype float32)
    timeout 240 python3 -m oasiskv.entrypoints.cli eval passkey "${eval_flags[@]}" --context-len 32000 \
      --depths 0.1 0.5 0.9 --seeds 0 --drafters self self:top_k_blocks=32 \
      --output-json "$OUT/passkey_32k.json" 2>&1 | tail -12
    timeout 240 python3 -m oasiskv.entrypoints.cli eval passkey "${eval_flags[@]}" --context-len 32000 --keys 4 \
      --depths 0.1 0.5 0.9 --seeds 0 --drafters self self:top_k_blocks=32 \
      --output-json "$OUT/passkey_multikey4_32k.json" 2>&1 | tail -12
    timeout 240 python3 -m oasiskv.entrypoints.cli eval fidelity "${eval_flags[@]}" --texts code --context-len 32000 \
      --forced-tokens 128 --free-tokens 0 --output-json "$OUT/fidelity_32k_k128.json" 2>&1 | tail -12 ;;
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
