"""`oasiskv bench throughput`: offline throughput with random prompts, vLLM's flags and output line."""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from oasiskv.bench.ceilings import measure as measure_ceilings
from oasiskv.bench.roofline import HBM_BYTES_PER_S, prefill_flops
from oasiskv.entrypoints.args import engine_config


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--warmup-prompts", type=int, default=1,
                   help="prompts of --input-len run before the timed ones, so kernels compile outside the timing")
    p.add_argument("--output-json", default=None, help="write the result here")


def run_throughput(args) -> int:
    from oasiskv.engine.llm_engine import LLMEngine
    from oasiskv.sampling_params import SamplingParams

    import torch

    ceilings = measure_ceilings() if torch.cuda.is_available() else None  # before the model takes the memory
    t_load = time.perf_counter()
    engine = LLMEngine(engine_config(args))
    load_s = time.perf_counter() - t_load
    rng = np.random.default_rng(args.seed)
    vocab = engine.runner.model_config.vocab_size
    prompts = [rng.integers(0, vocab, size=args.input_len).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.output_len, ignore_eos=True)
    for _ in range(args.warmup_prompts):
        engine.add_request(rng.integers(0, vocab, size=args.input_len).tolist(), params)
    while engine.has_unfinished():
        engine.step()
    engine.step_stats.update({k: type(v)() for k, v in engine.step_stats.items()})  # count the timed prompts only
    for p in prompts:
        engine.add_request(p, params)
    start = time.perf_counter()
    outputs = []
    while engine.has_unfinished():
        outputs.extend(o for o in engine.step() if o.finished)
    elapsed = time.perf_counter() - start
    result = summarize(engine, outputs, elapsed, args, ceilings)
    result["load_seconds"] = load_s
    print_result(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def summarize(engine, outputs, elapsed: float, args, ceilings: dict | None = None) -> dict:
    st = engine.step_stats
    n_out = sum(len(o.token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    decode_step = st["decode_time"] / max(st["decode_steps"], 1)
    roof_s = st["decode_bytes"] / HBM_BYTES_PER_S
    mc = engine.runner.model_config
    linear, attention = (sum(x) for x in zip(*(prefill_flops(mc, len(o.prompt_token_ids)) for o in outputs)))
    prefill_flop_s = (linear + attention) / st["prefill_time"] if st["prefill_time"] else 0.0
    measured = {"ceilings": ceilings}
    if ceilings:
        measured["prefill_gemm_fraction"] = prefill_flop_s / ceilings["bf16_gemm_flops_per_s"]
        measured["decode_copy_fraction"] = (st["decode_bytes"] / ceilings["copy_bytes_per_s"] / st["decode_time"]
                                            if st["decode_time"] else 0.0)
    return measured | {
        "model": engine.runner.model_config.name, "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "device": engine.runner.device.type, "input_len": args.input_len, "output_len": args.output_len,
        "num_prompts": len(outputs), "elapsed_time": elapsed,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (n_in + n_out) / elapsed,
        "output_tokens_per_second": n_out / elapsed,
        "decode_steps": st["decode_steps"], "mean_decode_step_ms": 1e3 * decode_step,
        "mean_decode_batch": st["decode_tokens"] / max(st["decode_steps"], 1),
        "decode_bytes_per_step": st["decode_bytes"] / max(st["decode_steps"], 1),
        "decode_roofline_fraction": roof_s / st["decode_time"] if st["decode_time"] else 0.0,
        "prefill_seconds": st["prefill_time"], "decode_seconds": st["decode_time"],
        "prefill_tokens_per_second": st["prefill_tokens"] / st["prefill_time"] if st["prefill_time"] else 0.0,
        "prefill_linear_flops": linear, "prefill_attention_flops": attention, "prefill_flops_per_second": prefill_flop_s,
        "num_pages": engine.block_manager.num_pages,
        "cuda_graphs": bool(engine.runner.graphs),
    }


def print_result(r: dict) -> None:
    print(f"Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total tokens/s, "
          f"{r['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Decode: {r['decode_steps']} steps, mean step {r['mean_decode_step_ms']:.2f} ms at mean batch "
          f"{r['mean_decode_batch']:.1f}, {r['decode_bytes_per_step'] / 1e9:.2f} GB read per step "
          f"(weights + KV), {100 * r['decode_roofline_fraction']:.1f}% of the byte roofline "
          f"({HBM_BYTES_PER_S / 1e12:.2f} TB/s)"
          + (f", {100 * r['decode_copy_fraction']:.1f}% of this card's measured copy rate "
             f"({r['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s)" if r.get("ceilings") else ""))
    print(f"Prefill: {r['prefill_tokens_per_second']:.0f} tokens/s, {r['prefill_flops_per_second'] / 1e12:.1f} "
          f"TFLOP/s counted ({r['prefill_linear_flops'] / 1e12:.1f} linear + {r['prefill_attention_flops'] / 1e12:.1f} "
          f"attention TFLOP; a MoE layer's router and top-k experts only)"
          + (f", {100 * r['prefill_gemm_fraction']:.1f}% of this card's measured bf16 GEMM rate "
             f"({r['ceilings']['bf16_gemm_flops_per_s'] / 1e12:.0f} TFLOP/s)" if r.get("ceilings") else ""))
