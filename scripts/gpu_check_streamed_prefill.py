"""Prefill beyond HBM on the GPU: one prompt prefilled in pages (a pool that holds it) and through
the host pool (a pool a third its size, `sparse/streamed_prefill.py`), the same sparse engine
otherwise; greedy tokens must agree and the prefill rates are printed side by side, with each
step's seconds. Where the card cannot hold the long prompt (a 32B model's 36K), --in-hbm-prompt
gives the in-pool run a prompt that fits: then only the rates are compared.

    PYTHONPATH=. python3 scripts/gpu_check_streamed_prefill.py --model qwen3-8b --prompt 24576
    PYTHONPATH=. python3 scripts/gpu_check_streamed_prefill.py --model qwen3-32b --prompt 36864 \
        --in-hbm-prompt 24576 --kv-gb 8
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from oasiskv import LLM, SamplingParams


def timed(engine, ids: list[int], max_tokens: int):
    """(the request, seconds to its first token)."""
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    seq = engine.seqs[rid]
    torch.cuda.synchronize()
    t0, first, steps = time.perf_counter(), None, []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        if first is None:
            torch.cuda.synchronize()
            steps.append(round(time.perf_counter() - t, 4))
            if seq.output_token_ids:
                first = time.perf_counter() - t0
    return seq, first, steps


def prefill(model: str, kv_gb: float, ids: list[int], max_tokens: int) -> dict:
    """The prompt once to warm every kernel up (no prefix cache: the timed run computes it all),
    then timed."""
    llm = LLM(model=model, load_format="dummy", kv_cache_gb=kv_gb, sparse=True, host_kv_gb=16, max_num_seqs=4,
              max_model_len=len(ids) + max_tokens + 16, enforce_eager=True, enable_prefix_caching=False)
    engine = llm.engine
    timed(engine, ids, 1)
    seq, first, steps = timed(engine, ids, max_tokens)
    out = {"prompt": len(ids), "pool_pages": engine.block_manager.num_pages, "streamed": seq.streamed,
           "ttft_s": first, "prefill_tok_s": len(ids) / first, "step_s": steps, "tokens": list(seq.output_token_ids)}
    del llm, engine, seq
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--prompt", type=int, default=24576)
    p.add_argument("--in-hbm-prompt", type=int, default=None, help="the in-pool run's prompt (default: --prompt)")
    p.add_argument("--kv-gb", type=float, default=24, help="the in-pool run's KV budget")
    p.add_argument("--max-tokens", type=int, default=8)
    a = p.parse_args()
    ids = torch.randint(0, 1000, (a.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    in_hbm = prefill(a.model, a.kv_gb, ids[:a.in_hbm_prompt or a.prompt], a.max_tokens)
    page_gb = a.kv_gb / in_hbm["pool_pages"]
    streamed = prefill(a.model, page_gb * (a.prompt // 16) / 3, ids, a.max_tokens)
    same = in_hbm["prompt"] == streamed["prompt"]
    res = {"in_hbm": in_hbm, "streamed": streamed, "tokens_equal": in_hbm["tokens"] == streamed["tokens"] if same else None,
           "rate_ratio": streamed["prefill_tok_s"] / in_hbm["prefill_tok_s"]}
    print(json.dumps(res, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"streamed_prefill_{a.model}.json"), "w") as f:
            json.dump(res, f, indent=1)
    if res["tokens_equal"] is False:
        raise SystemExit("FAIL: streamed prefill's tokens differ from in-pool prefill's")


if __name__ == "__main__":
    main()
