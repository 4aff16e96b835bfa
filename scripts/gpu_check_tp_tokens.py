"""Greedy tokens at tensor-parallel size 2 against size 1, float32, on the GPUs.

PYTHONPATH=. python3 scripts/gpu_check_tp_tokens.py [--model qwen3-8b] [--prompt-len 4096]
Dummy weights (every rank slices the same whole checkpoint stream, so both sizes hold the same
model). Two short prompts decode dense and two long ones sparse through the pipeline at K =
--top-k-blocks (rows evict and fetch); size 1 runs first, then size 2 beside it on the first GPU
(both engines take --kv-cache-gb of KV pool). Prints one JSON line; exits 1 if a token differs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from oasiskv.entrypoints.llm import LLM
from oasiskv.sampling_params import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--top-k-blocks", type=int, default=32)
    ap.add_argument("--kv-cache-gb", type=float, default=8)
    ap.add_argument("--host-kv-gb", type=float, default=8)
    args = ap.parse_args()
    engine = dict(load_format="dummy", dtype="float32", max_model_len=args.prompt_len + args.max_tokens + 16,
                  max_num_seqs=4, kv_cache_gb=args.kv_cache_gb, sparse=True, top_k_blocks=args.top_k_blocks,
                  sparse_threshold=args.prompt_len // 2, host_kv_gb=args.host_kv_gb)
    gen = torch.Generator().manual_seed(0)
    lengths = (64, 300, args.prompt_len, args.prompt_len - 200)
    one = LLM(args.model, **engine)
    vocab = one.engine.runner.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    result = {"model": args.model, "prompt_lens": list(lengths), "max_tokens": args.max_tokens}
    t0 = time.perf_counter()
    want = one.generate(prompts, greedy)
    result["size_1_s"] = time.perf_counter() - t0
    two = LLM(args.model, tensor_parallel_size=2, **engine)
    try:
        t0 = time.perf_counter()
        got = two.generate(prompts, greedy)
        result["size_2_s"] = time.perf_counter() - t0
    finally:
        two.engine.runner.shutdown()
    result["sparse_steps"] = [[o.stats.get("sparse_steps") for o in outs] for outs in (want, got)]
    result["equal"] = [w.token_ids == g.token_ids for w, g in zip(want, got)]
    result["first_difference"] = [next((i for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids)) if a != b), None)
                                  for w, g in zip(want, got)]
    print(json.dumps(result))
    return 0 if all(result["equal"]) else 1


if __name__ == "__main__":
    sys.exit(main())
