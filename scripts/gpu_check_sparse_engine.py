"""The sparse engine path on CUDA: full-budget sparse decode against dense on the same weights.

PYTHONPATH=. python3 scripts/gpu_check_sparse_engine.py [--model smollm2-135m] [--prompt-len 2048]
Dummy weights (no real checkpoint travels to the GPU machine): compares every step's logits
(relative error) and the greedy tokens, then runs a capped budget three ways (pipeline with
async scheduling, pipeline synchronous, the in-line reference of tests/inline_reference.py):
their tokens must agree; then the
prompts in chunks, whose host extents must hold their dense pages' K/V at the conversion.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from oasiskv.entrypoints.llm import LLM
from oasiskv.sampling_params import SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from inline_reference import inline_llm  # noqa: E402  (the in-line reference the pipeline is checked against)
from oasiskv.sparse.tuning import STAGE_FORKS, PipelineTuning


def record_logits(llm):
    model, seen = llm.engine.runner.model, []
    original = model.compute_logits

    def recording(hidden):
        out = original(hidden)
        seen.append(out.float().clone())
        return out
    model.compute_logits = recording
    return seen


def check_prefill_copies(model: str, prompts, params, common) -> list:
    """The prompts prefilled in chunks of 512: each chunk's completed blocks go to the host on a
    stream of their own while the next chunk computes (oasiskv/sparse/prefill_copies.py). At
    each conversion, (blocks copied while prefilling, blocks, host extent == the dense pages)."""
    from oasiskv.sparse.manager import SparseManager

    checked, convert = [], SparseManager.convert

    def checking_convert(self, seq, last_q, pages, summary_run):
        nb = -(-seq.num_cached_tokens // self.block_size)
        before = seq.prefill_blocks_on_host
        slots = (torch.tensor(seq.pages[:nb], device=self.device)[:, None] * self.Hkv
                 + torch.arange(self.Hkv, device=self.device)).flatten()
        want = self.kv[:, slots].reshape(self.L, nb, self.Hkv, *self.kv.shape[2:]).cpu()
        convert(self, seq, last_q, pages, summary_run)
        got = self.host.extent_items(seq.host_extent)[:, :nb]
        checked.append((before, nb, torch.equal(got, want)))

    SparseManager.convert = checking_convert
    try:
        llm = LLM(model, sparse=True, top_k_blocks=32, sparse_threshold=1024, host_kv_gb=4.0,
                  max_num_batched_tokens=512, **common)
        llm.generate(prompts, params)
        del llm
        torch.cuda.empty_cache()
    finally:
        SparseManager.convert = convert
    return checked


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--summary-dtype", default="auto", help="auto (fp8 on CUDA) | kv | fp8")
    ap.add_argument("--attention-splits", type=int, default=None,
                    help="splits of the working-set attention, pipelined and in-line (default: the pipeline's)")
    ap.add_argument("--stages-fork", default=None, choices=STAGE_FORKS,
                    help="the part of each layer after which the pipelined step's stages start "
                         "(default: the pipeline's, from the context)")
    a = ap.parse_args()
    tuning = PipelineTuning(stages_fork=a.stages_fork)  # every engine below: both paths read the splits
    if a.attention_splits is not None:
        tuning = dataclasses.replace(tuning, attention_splits=a.attention_splits)
    common = dict(load_format="dummy", dtype=a.dtype, max_model_len=a.prompt_len + a.steps + 16, max_num_seqs=4,
                  kv_cache_gb=4.0, summary_dtype=a.summary_dtype, pipeline_tuning=tuning)
    g = torch.Generator().manual_seed(0)
    vocab_probe = LLM(a.model, **common)
    prompts = [torch.randint(0, vocab_probe.engine.runner.model_config.vocab_size, (a.prompt_len,),
                             generator=g).tolist() for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=a.steps + 1, ignore_eos=True)
    seen = record_logits(vocab_probe)
    dense = vocab_probe.generate(prompts, params)
    dense_logits = seen[:]
    del vocab_probe
    torch.cuda.empty_cache()
    nblocks = -(-(a.prompt_len + a.steps) // 16)
    sparse = LLM(a.model, sparse=True, top_k_blocks=nblocks, sparse_threshold=1024, host_kv_gb=4.0,
                 **common)
    seen = record_logits(sparse)
    t0 = time.perf_counter()
    out = sparse.generate(prompts, params)
    sparse_s = time.perf_counter() - t0
    # Step i's logits hold both requests' rows (decode steps of the sparse engine hold 2 rows each).
    rel = []
    for d, s in zip(dense_logits[1:], seen[1:]):
        s = s[::2] if s.shape[0] == 2 * d.shape[0] else s
        rel.append(((s - d).norm(dim=-1) / d.norm(dim=-1)).max().item())
    same = [o.token_ids == d.token_ids for o, d in zip(out, dense)]
    # The first step where the tokens part: the logits after it see different inputs.
    first_diff = min((next((i for i, (x, y) in enumerate(zip(o.token_ids, d.token_ids)) if x != y), a.steps + 1)
                      for o, d in zip(out, dense)))
    del sparse
    capped, overlapped = {}, 0
    # The capped budget through the pipeline (async scheduling, then synchronous) and through the
    # in-line path.
    for mode, sync in (("on", "on"), ("on", "off"), ("off", "off")):
        build = LLM if mode == "on" else inline_llm
        llm = build(model=a.model, sparse=True, top_k_blocks=32, sparse_threshold=1024, host_kv_gb=4.0,
                    async_scheduling=sync, **common)
        capped[mode, sync] = llm.generate(prompts, params)
        overlapped = max(overlapped, llm.engine.step_stats["overlapped_steps"] if sync == "on" else 0)
        del llm
        torch.cuda.empty_cache()
    pipeline_same = [x.token_ids == y.token_ids for x, y in zip(capped["on", "off"], capped["off", "off"])]
    async_same = [x.token_ids == y.token_ids and x.stats["draft_acceptance"] == y.stats["draft_acceptance"]
                  for x, y in zip(capped["on", "on"], capped["on", "off"])]
    ok = max(rel) < 3e-2 and all(same)
    print("PASS" if ok else "FAIL", f"full-budget sparse vs dense: max relative logit error {max(rel):.2e}, "
          f"tokens equal {same}", flush=True)
    print("PASS" if all(pipeline_same) else "FAIL", f"capped budget, pipeline vs in-line tokens equal {pipeline_same}")
    print("PASS" if all(async_same) and overlapped else "FAIL", f"capped budget, pipeline with async scheduling vs "
          f"without: tokens and draft acceptance equal {async_same}, {overlapped} overlapped steps", flush=True)
    prefill_copies = check_prefill_copies(a.model, prompts, params, common)
    copies_ok = bool(prefill_copies) and all(ok and before > 0 for before, _, ok in prefill_copies)
    print("PASS" if copies_ok else "FAIL", f"prompts in chunks of 512: (blocks on the host before the conversion, "
          f"blocks, host extent equal to the dense pages) {prefill_copies}")
    res = {"model": a.model, "dtype": a.dtype, "prompt_len": a.prompt_len,
           "summary_dtype": a.summary_dtype,
           "attention_splits": a.attention_splits, "stages_fork": a.stages_fork,
           "max_rel_logit_err_before_tokens_part": max(rel[:first_diff] or [0.0]),
           "rel_logit_err_per_step": rel, "first_differing_token": first_diff,
           "tokens_equal": same, "sparse_full_budget_seconds": sparse_s,
           "full_budget_stats": out[0].stats, "capped_stats": capped["on", "off"][0].stats,
           "capped_in_line_stats": capped["off", "off"][0].stats,
           "capped_pipeline_tokens_equal_in_line": pipeline_same,
           "capped_async_equal_sync": async_same, "async_overlapped_steps": overlapped,
           "prefill_copies_blocks_before_conversion_blocks_host_equal": prefill_copies}
    print(json.dumps(res, indent=1))
    if os.environ.get("OUT"):
        fp8 = "_fp8_summaries" if a.summary_dtype == "fp8" else ""
        name = f"sparse_engine_{os.path.basename(a.model)}_{a.dtype}_{a.prompt_len}{fp8}.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(res, f, indent=2)
    if not (ok and all(pipeline_same) and all(async_same) and overlapped and copies_ok):
        sys.exit(1)  # a failed check fails the command


if __name__ == "__main__":
    main()
