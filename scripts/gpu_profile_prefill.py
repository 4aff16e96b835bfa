"""Where a long prompt's prefill time goes: one 32K-token prompt through the engine (`qwen3-8b`
dummy weights, bf16, one chunk or several) under torch.profiler, its GPU kernel time grouped by
kind (GEMM, attention, norms, rotary, KV writes, the rest) against the step's wall time, and the
kinds' share of the FLOPs-only lower bound (bench.roofline.prefill_flops at 989 TFLOP/s).

    PYTHONPATH=. python3 scripts/gpu_profile_prefill.py [--input-len 32768] [--chunk 32768 4096]
    (a smoke run on CPU: --model smollm2-135m --input-len 512 --chunk 512 256; there it groups ops)

Prints a table per chunk size; JSON to $OUT/prefill_profile.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import defaultdict

import numpy as np
import torch

from oasiskv.bench.roofline import BF16_FLOPS_PER_S, prefill_flops

KINDS = [  # first match wins: (kind, pattern over the kernel's name)
    ("attention", r"prefill_kernel|paged_prefill|flash|fmha|attention|sdpa"),
    ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|matmul|cublas|aten::mm|addmm"),
    ("kv write", r"scatter|index_put|write_kv|reshape_and_cache|copy_kv"),
    ("norm", r"norm|rsqrt"),
    ("rotary", r"rotary|rope|cos|sin"),
    ("activation", r"silu|gelu|act_and_mul|mul_kernel|sigmoid"),
    ("copy / cast", r"copy|cast|convert|cat|fill"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, low)), "other")


def profile_chunk(engine, prompt: list[int], chunk: int) -> dict:
    from oasiskv.sampling_params import SamplingParams

    engine.scheduler.max_num_batched_tokens = chunk
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request(prompt, params)  # warm-up at this chunk size
    while engine.has_unfinished():
        engine.step()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        t0 = time.perf_counter()
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        sync()
        wall = time.perf_counter() - t0
    by_kind: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        us = e.device_time_total if cuda else e.self_cpu_time_total  # on CPU (a smoke run): ops, not kernels
        if us and e.key and not e.key.startswith("ProfilerStep"):
            by_kind[kind_of(e.key)] += us / 1e6
            top[e.key] += us / 1e6
    linear, attention = prefill_flops(engine.runner.model_config, len(prompt))
    return {"chunk": chunk, "wall_s": wall, "kernel_s": sum(by_kind.values()),
            "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top_kernels_s": dict(sorted(top.items(), key=lambda kv: -kv[1])[:15]),
            "linear_bound_s": linear / BF16_FLOPS_PER_S, "attention_bound_s": attention / BF16_FLOPS_PER_S,
            "tokens_per_s": len(prompt) / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--input-len", type=int, default=32768)
    ap.add_argument("--chunk", type=int, nargs="+", default=[32768, 4096])
    a = ap.parse_args()
    from oasiskv.config import EngineConfig
    from oasiskv.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=a.model, load_format="dummy", max_num_batched_tokens=max(a.chunk),
                                    max_num_seqs=4, max_model_len=a.input_len + 64, enable_prefix_caching=False))
    prompt = np.random.default_rng(0).integers(0, engine.runner.model_config.vocab_size, a.input_len).tolist()
    results = []
    for chunk in a.chunk:
        r = profile_chunk(engine, prompt, chunk)
        results.append(r)
        print(f"\n{a.model}, one {a.input_len}-token prompt, chunks of {chunk}: {r['wall_s']:.3f} s wall "
              f"({r['tokens_per_s']:,.0f} tokens/s), GPU kernels {r['kernel_s']:.3f} s; FLOPs bound: linear "
              f"{r['linear_bound_s']:.3f} s, attention {r['attention_bound_s']:.3f} s")
        for kind, s in r["by_kind_s"].items():
            print(f"  {kind:<12} {s:8.3f} s  {100 * s / r['wall_s']:5.1f}% of wall")
        print("  top kernels:")
        for name, s in list(r["top_kernels_s"].items())[:10]:
            print(f"    {s:8.3f} s  {name[:100]}")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "prefill_profile.json"), "w") as f:
        json.dump({"model": a.model, "input_len": a.input_len, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
