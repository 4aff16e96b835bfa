"""Fidelity of sparse decode to dense on real long text.

Teacher-forced: both engines decode the text's own next tokens after a long prompt (forced
through `TeacherForcing`), and at each step we compare their next-token distributions: top-1
agreement, mean KL(dense ‖ sparse), and the perplexity of each on the text. The first
generated token comes from the prompt's prefill, which is dense in both, so only the decode
steps (sparse in the sparse engine) are scored.

Free-running: both decode greedily from the same prompt; we report how many tokens come out
identical before the first difference.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class DenseReference:
    """Everything the sparse runs are compared with, computed once."""
    prompts: list[list[int]]
    continuations: list[list[int]]
    logprobs: list  # [M, V] float32 tensor per text
    free_tokens: list[list[int]]  # greedy dense continuation per text


def add_fidelity_args(p) -> None:
    p.add_argument("--texts", nargs="+", default=["code", "prose"],
                   help="code (Python's typing module), prose (a license text), manual (the language "
                        "reference's topics, ~100K tokens of English) or file paths")
    p.add_argument("--context-len", type=int, default=4000, help="prompt tokens of each text")
    p.add_argument("--forced-tokens", type=int, default=256, help="teacher-forced tokens per text")
    p.add_argument("--free-tokens", type=int, default=64, help="greedy tokens per text (0: skip)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--output-json", default=None)


def sparse_eval_config(base, context_len: int, new_tokens: int):
    """The user's sparse flags, converting right after the prompt's prefill."""
    sparse = base.with_sparse(enabled=True, sparse_threshold=min(base.sparse.sparse_threshold, context_len))
    return replace(sparse, max_model_len=base.max_model_len or context_len + new_tokens + 16)


def split_texts(tokenizer, texts: list[str], context_len: int, forced: int):
    from oasiskv.eval.texts import text_tokens
    ids = [text_tokens(tokenizer, t, context_len + forced) for t in texts]
    return [i[:context_len] for i in ids], [i[context_len:] for i in ids]


def decode_both(llm, prompts, continuations, free_tokens: int):
    """Teacher-forced log-probabilities and greedy free-running tokens, in one batch."""
    from oasiskv.eval.teacher_forcing import forced_logprobs
    from oasiskv.sampling_params import SamplingParams

    extra = []
    if free_tokens:
        greedy = SamplingParams(temperature=0, max_tokens=free_tokens, ignore_eos=True)
        extra = [(p, greedy) for p in prompts]
    logprobs, free = forced_logprobs(llm, prompts, continuations, extra)
    return logprobs, [o.token_ids for o in free] if free_tokens else [[] for _ in prompts]


def dense_reference(llm, texts, context_len: int, forced: int, free_tokens: int) -> DenseReference:
    """`llm`: a dense engine whose max_model_len fits context_len + new tokens."""
    prompts, conts = split_texts(llm.tokenizer, texts, context_len, forced)
    logprobs, free = decode_both(llm, prompts, conts, free_tokens)
    return DenseReference(prompts, conts, logprobs, free)


def compare(ref: DenseReference, logprobs: list[torch.Tensor], free: list[list[int]]) -> dict:
    """Teacher-forced figures over the decode steps (step 0, the prefill's, is dense in both),
    pooled over the texts; free-running: identical tokens before the first difference."""
    import torch

    d = torch.cat([lp[1:] for lp in ref.logprobs])
    s = torch.cat([lp[1:] for lp in logprobs])
    t = torch.tensor([tok for c in ref.continuations for tok in c[1:]])
    step_nll_d, step_nll_s = -d.gather(1, t[:, None])[:, 0], -s.gather(1, t[:, None])[:, 0]
    nll_d, nll_s = step_nll_d.mean(), step_nll_s.mean()
    kl = (d.exp() * (d - s)).sum(-1)
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                  for x, y in zip(ref.free_tokens, free)]
    return {"steps": len(t), "top1_agreement": float((d.argmax(-1) == s.argmax(-1)).float().mean()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "ppl_dense": math.exp(float(nll_d)), "ppl_sparse": math.exp(float(nll_s)),
            "ppl_ratio": math.exp(float(nll_s - nll_d)),
            "free_running_identical_tokens": first_diff,
            # per scored step, texts in order: where a perplexity ratio comes from
            "per_step": {"kl": [round(float(x), 5) for x in kl],
                         "nll_dense": [round(float(x), 5) for x in step_nll_d],
                         "nll_sparse": [round(float(x), 5) for x in step_nll_s],
                         "top1_same": (d.argmax(-1) == s.argmax(-1)).tolist()}}


def measure_sparse(llm, ref: DenseReference, free_tokens: int) -> dict:
    logprobs, free = decode_both(llm, ref.prompts, ref.continuations, free_tokens)
    return compare(ref, logprobs, free)


def run_fidelity(args) -> int:
    from oasiskv.entrypoints.args import engine_config

    from oasiskv.entrypoints.llm import LLM

    base = engine_config(args)
    cfg = sparse_eval_config(base, args.context_len, max(args.forced_tokens, args.free_tokens))
    ref = dense_reference(LLM.from_config(cfg.with_sparse(enabled=False)), args.texts, args.context_len,
                          args.forced_tokens, args.free_tokens)
    res = measure_sparse(LLM.from_config(cfg), ref, args.free_tokens)
    results = {"context_len": args.context_len, "texts": args.texts, "forced_tokens": args.forced_tokens,
               "free_tokens": args.free_tokens,
               "sparse": {k: getattr(cfg.sparse, k) for k in (
                   "top_k_blocks", "sink_blocks", "window_blocks", "fetch_ratio", "fetch_cap", "drafter",
                   "sparse_threshold", "summary_dtype")}} | res
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    if args.json:
        print(json.dumps(results))
    else:
        print_fidelity_table(results)
    return 0


def print_fidelity_table(r: dict) -> None:
    print(f"\nfidelity to dense, {r['context_len']}-token prompts, texts {r['texts']}; sparse: {r['sparse']}")
    print(f"teacher-forced over {r['steps']} decode steps:")
    print("| top-1 agreement | mean KL(dense‖sparse) | max KL | ppl dense | ppl sparse | ratio |")
    print("|---|---|---|---|---|---|")
    print(f"| {100 * r['top1_agreement']:.2f}% | {r['kl_mean']:.5f} | {r['kl_max']:.4f} | {r['ppl_dense']:.4f} "
          f"| {r['ppl_sparse']:.4f} | {r['ppl_ratio']:.4f} |")
    if r["free_tokens"]:
        print(f"free-running greedy: identical tokens before the first difference, per text "
              f"(of {r['free_tokens']}): {r['free_running_identical_tokens']}")
