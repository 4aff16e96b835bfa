"""Dense-engine benchmark on the GPU machine, in one process: the engine against its HF peer.

PYTHONPATH=. python3 scripts/gpu_bench_dense.py [--quick]
Runs: the HF transformers peer on the same weights, `bench throughput` 1024/256 x 256 prompts,
and the decode-heavy case (batch 16, 32K-token prompts, 256 outputs). Writes JSON under $OUT.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from oasiskv.bench.hf_peer import build_hf_model, time_hf_generate
from oasiskv.bench.throughput import print_result, summarize
from oasiskv.config import EngineConfig
from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.models.loader import resolve_model
from oasiskv.sampling_params import SamplingParams


def run_ours(model, input_len, output_len, num_prompts, max_num_seqs, **kw):
    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", max_num_seqs=max_num_seqs,
                                    max_model_len=input_len + output_len + 16, **kw))
    g = torch.Generator().manual_seed(0)
    vocab = engine.runner.model_config.vocab_size
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    for _ in range(num_prompts):
        engine.add_request(torch.randint(0, vocab, (input_len,), generator=g).tolist(), params)
    t0 = time.perf_counter()
    outs = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.finished)
    elapsed = time.perf_counter() - t0
    args = argparse.Namespace(input_len=input_len, output_len=output_len)
    r = summarize(engine, outs, elapsed, args)
    print_result(r)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    ap.add_argument("--async-modes", default="off,on", help="async scheduling modes to run each case in")
    a = ap.parse_args()
    out_dir = os.environ.get("OUT", ".")
    results = {"model": a.model, "device": torch.cuda.get_device_name(0)}
    q = a.quick
    src = resolve_model(a.model, "dummy")
    if not a.no_hf:
        hf = build_hf_model(src, torch.bfloat16, torch.device("cuda"))
        results["hf_peer"] = time_hf_generate(hf, 16, 1024, 64 if q else 256, src.config.vocab_size)
        print("HF peer:", results["hf_peer"], flush=True)
        del hf
        gc.collect()
        torch.cuda.empty_cache()
    # Each case with async scheduling off and on, side by side in this process.
    cases = {"ours_peer_shape": (1024, 64 if q else 256, 16, 16),
             "throughput": (1024, 64 if q else 256, 64 if q else 256, 256),
             "decode_heavy_32k": (4096 if q else 32768, 64 if q else 256, 16, 16)}
    modes = a.async_modes.split(",")
    for name, shape in cases.items():
        for mode in modes:
            results[f"{name}_async_{mode}"] = run_ours(a.model, *shape, async_scheduling=mode)
    with open(os.path.join(out_dir, "dense_bench.json"), "w") as f:
        json.dump(results, f, indent=2)
    print("\n| case | output tok/s | decode step ms | roofline |")
    print("|---|---|---|---|")
    if "hf_peer" in results:
        hp = results["hf_peer"]
        print(f"| HF generate b16 1024/{hp['output_len']} | {hp['output_tokens_per_second']:.0f} | "
              f"{hp['mean_decode_step_ms']:.2f} | |")
    for k in (f"{name}_async_{mode}" for name in cases for mode in modes):
        r = results[k]
        print(f"| {k} {r['input_len']}/{r['output_len']} x{r['num_prompts']} | "
              f"{r['output_tokens_per_second']:.0f} | {r['mean_decode_step_ms']:.2f} | "
              f"{100 * r['decode_roofline_fraction']:.1f}% |")


if __name__ == "__main__":
    main()
