"""Long-prompt prefill on the GPU machine: the engine's tokens/s per chunk size, the fraction of
the bf16 peak, HF transformers' one-pass prefill of the same prompts, and the inter-token latency
of running decode rows while a long prompt prefills.

    PYTHONPATH=. python3 scripts/gpu_bench_prefill.py [--parts hf,throughput,itl] [--quick]

hf: HF transformers' forward over the prompts in batches of --hf-batch, one pass each (no KV
cache kept, logits of the last position only), timed after a warm-up.
throughput: `qwen3-8b` dummy weights, bf16, --num-prompts x --input-len prompts, output 2, at
each --chunks value of --max-num-batched-tokens, one engine for all (its memory profile sized
for the largest chunk; the chunk budget is the scheduler's, set before each run). Prefill
tokens/s = prompt tokens / the prefill steps' time; FLOPs as `bench.roofline.prefill_flops`
(every linear layer, causal attention) over 989 TFLOP/s.
itl: --itl-rows requests decoding at --itl-context tokens, then one --input-len prompt arrives;
per chunk size: the running rows' ITL before it, the longest gap while it prefills, how many
decode steps ran meanwhile, its TTFT, and the prefill steps' durations.
Prints a table per part; JSON to $OUT/prefill_bench.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import numpy as np
import torch

from oasiskv.bench.roofline import BF16_FLOPS_PER_S, prefill_flops
from oasiskv.models.loader import resolve_model

# A smoke run (--quick) works on CPU too, in float32 (as the engine's default there).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def prompts_for(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=length).tolist() for _ in range(n)]


# --------------------------------------------------------------------------- HF transformers

@torch.inference_mode()
def run_hf(model_name: str, prompts: list[list[int]], batch: int) -> dict:
    from oasiskv.bench.hf_peer import build_hf_model

    src = resolve_model(model_name, "dummy")
    model = build_hf_model(src, DTYPE, torch.device(DEVICE))
    ids = torch.tensor(prompts, device=DEVICE)
    model(input_ids=ids[:1, :1024], use_cache=False, logits_to_keep=1)  # warm-up
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        model(input_ids=ids[i:i + batch], use_cache=False, logits_to_keep=1)
    sync()
    seconds = time.perf_counter() - t0
    tokens = ids.numel()
    linear, attention = (len(prompts) * x for x in prefill_flops(src.config, ids.shape[1]))
    r = {"batch": batch, "num_prompts": len(prompts), "input_len": ids.shape[1], "seconds": seconds,
         "prefill_tokens_per_second": tokens / seconds,
         "peak_fraction": (linear + attention) / seconds / BF16_FLOPS_PER_S,
         "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    del model, ids
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    print(f"HF transformers one pass, {len(prompts)} x {r['input_len']} in batches of {batch}: "
          f"{seconds:.2f} s, {r['prefill_tokens_per_second']:,.0f} tokens/s, "
          f"{100 * r['peak_fraction']:.1f}% of bf16 peak ({r['attn_implementation']})", flush=True)
    return r


# --------------------------------------------------------------------------- the engine

def build_engine(model_name: str, max_chunk: int, max_model_len: int):
    from oasiskv.config import EngineConfig
    from oasiskv.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model_name, load_format="dummy", max_num_batched_tokens=max_chunk,
                                    max_num_seqs=32, max_model_len=max_model_len,
                                    enable_prefix_caching=False))  # every run prefills the same prompts
    print(f"engine ready in {time.perf_counter() - t0:.0f} s, {engine.block_manager.num_pages} pages", flush=True)
    return engine


def drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def run_throughput(engine, prompts: list[list[int]], chunk: int) -> dict:
    from oasiskv.sampling_params import SamplingParams

    engine.scheduler.max_num_batched_tokens = chunk
    engine.runner.warm_up_prefill(chunk)  # as a server started with this chunk budget does
    before = dict(engine.step_stats)
    params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    t0 = time.perf_counter()
    drain(engine)
    elapsed = time.perf_counter() - t0
    st = {k: engine.step_stats[k] - before[k] for k in before}
    mc = engine.runner.model_config
    linear, attention = (sum(x) for x in zip(*(prefill_flops(mc, len(p)) for p in prompts)))
    n_in = sum(len(p) for p in prompts)
    r = {"chunk": chunk, "num_prompts": len(prompts), "input_len": len(prompts[0]),
         "elapsed_time": elapsed, "tokens_per_second": (n_in + 2 * len(prompts)) / elapsed,
         "prefill_steps": st["prefill_steps"], "prefill_seconds": st["prefill_time"],
         "prefill_tokens_per_second": st["prefill_tokens"] / st["prefill_time"],
         "linear_flops": linear, "attention_flops": attention,
         "peak_fraction": (linear + attention) / st["prefill_time"] / BF16_FLOPS_PER_S}
    print(f"chunk {chunk:6d}: {r['prefill_tokens_per_second']:8,.0f} prefill tokens/s "
          f"({100 * r['peak_fraction']:.1f}% of bf16 peak), {st['prefill_steps']} prefill steps, "
          f"{r['tokens_per_second']:,.0f} total tokens/s over {elapsed:.2f} s", flush=True)
    return r


def run_itl(engine, rows: list[str], long_prompt: list[int], chunk: int, steps_before: int = 16,
            steps_after: int = 8) -> dict:
    """The running rows decode `steps_before` steps, then the long prompt arrives; stepping goes
    on until it has its first token and `steps_after` more steps have run."""
    from oasiskv.sampling_params import SamplingParams

    engine.scheduler.max_num_batched_tokens = chunk
    seen = {rid: len(engine.seqs[rid].output_token_ids) for rid in rows}
    arrivals: dict[str, list[float]] = {rid: [] for rid in rows}
    prefill_steps_ms: list[float] = []

    def step() -> list:
        n_prefill = engine.step_stats["prefill_steps"]
        t0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        if engine.step_stats["prefill_steps"] > n_prefill:
            prefill_steps_ms.append(1e3 * (now - t0))
        for o in outs:
            if o.request_id in arrivals and len(o.token_ids) > seen[o.request_id]:
                seen[o.request_id] = len(o.token_ids)
                arrivals[o.request_id].append(now)
        return outs

    for _ in range(steps_before):
        step()
    marks = {rid: len(a) for rid, a in arrivals.items()}
    prefill_steps_ms.clear()
    t_arrive = time.perf_counter()
    long_id = engine.add_request(long_prompt, SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True))
    ttft = None
    while ttft is None:
        for o in step():
            if o.request_id == long_id:
                ttft = time.perf_counter() - t_arrive
    t_done = time.perf_counter()
    for _ in range(steps_after):
        step()

    def gaps(times):
        return [b - a for a, b in zip(times, times[1:])]

    before = [g for rid in rows for g in gaps(arrivals[rid][:marks[rid]])]
    # The gaps from each row's last token before the arrival to its first token after the prefill.
    during = []
    for rid in rows:
        ts = arrivals[rid]
        inside = [t for t in ts[marks[rid]:] if t <= t_done]
        first_after = [t for t in ts[marks[rid]:] if t > t_done][:1]
        during.extend(gaps(ts[marks[rid] - 1:marks[rid]] + inside + first_after))
    decode_steps_during = statistics.median(
        sum(1 for t in arrivals[rid] if t_arrive < t <= t_done) for rid in rows)
    r = {"chunk": chunk, "rows": len(rows), "itl_median_before_ms": 1e3 * statistics.median(before),
         "itl_max_during_ms": 1e3 * max(during), "itl_mean_during_ms": 1e3 * statistics.mean(during),
         "decode_steps_during_prefill": decode_steps_during, "ttft_s": ttft,
         "prefill_steps": len(prefill_steps_ms),
         # A mid-prompt chunk's step does not wait for the device (nothing is sampled): single
         # steps' times shift onto the next, their mean is the device's time per chunk.
         "prefill_step_ms_mean": statistics.mean(prefill_steps_ms) if prefill_steps_ms else None}
    print(f"chunk {chunk:6d}: ITL before {r['itl_median_before_ms']:6.1f} ms, during the prefill max "
          f"{r['itl_max_during_ms']:7.1f} ms / mean {r['itl_mean_during_ms']:6.1f} ms, "
          f"{decode_steps_during} decode steps meanwhile; TTFT {ttft:.2f} s over {len(prefill_steps_ms)} "
          f"prefill steps of {r['prefill_step_ms_mean'] or 0:.0f} ms on average",
          flush=True)
    return r


def start_rows(engine, n: int, context: int, vocab: int) -> list[str]:
    """n requests with `context`-token prompts, prefilled and decoding (they never finish here)."""
    from oasiskv.sampling_params import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=100_000, ignore_eos=True)
    rows = [engine.add_request(p, params) for p in prompts_for(vocab, n, context, seed=1)]
    while any(not engine.seqs[r].output_token_ids for r in rows):
        engine.step()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--parts", default="hf,throughput,itl")
    ap.add_argument("--input-len", type=int, default=32768)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--chunks", default="2048,4096,8192,16384,32768", help="--max-num-batched-tokens values")
    ap.add_argument("--hf-batch", type=int, default=4)
    ap.add_argument("--itl-rows", type=int, default=16)
    ap.add_argument("--itl-context", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run of every part (CPU too)")
    a = ap.parse_args()
    if a.quick:
        a.input_len, a.num_prompts, a.chunks, a.hf_batch, a.itl_rows, a.itl_context = 1024, 2, "256,1024", 2, 2, 256
    parts = a.parts.split(",")
    chunks = [int(c) for c in a.chunks.split(",")]
    out_dir = os.environ.get("OUT", ".")
    device = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"
    results = {"model": a.model, "device": device, "torch": torch.__version__,
               "input_len": a.input_len, "num_prompts": a.num_prompts, "bf16_peak_flops": BF16_FLOPS_PER_S}

    def save():
        with open(os.path.join(out_dir, "prefill_bench.json"), "w") as f:
            json.dump(results, f, indent=2)

    vocab = resolve_model(a.model, "dummy").config.vocab_size
    prompts = prompts_for(vocab, a.num_prompts, a.input_len)
    if "hf" in parts:
        results["hf"] = run_hf(a.model, prompts, a.hf_batch)
        save()
    if "throughput" in parts or "itl" in parts:
        engine = build_engine(a.model, max(chunks), a.input_len + 1024)
        # Warm-up: two chunks (a first one and one after a prefix) compile every kernel.
        run_throughput(engine, prompts_for(vocab, 1, 2 * min(chunks), seed=2), min(chunks))
        if "throughput" in parts:
            results["throughput"] = [run_throughput(engine, prompts, c) for c in chunks]
            save()
        if "itl" in parts:
            rows = start_rows(engine, a.itl_rows, a.itl_context, vocab)
            results["itl"] = [run_itl(engine, rows, prompts[0], c) for c in chunks]
            save()
            for rid in rows:
                engine.abort(rid)

    print(f"\n{a.num_prompts} x {a.input_len} prompts, output 2, {a.model} dummy weights, {DTYPE}")
    print("| prefill | --max-num-batched-tokens | prefill tokens/s | of bf16 peak |")
    print("| --- | ---: | ---: | ---: |")
    for r in results.get("throughput", []):
        print(f"| oasiskv | {r['chunk']} | {r['prefill_tokens_per_second']:,.0f} | {100 * r['peak_fraction']:.1f}% |")
    if "hf" in results:
        r = results["hf"]
        print(f"| HF transformers, one pass, batch {r['batch']} | - | {r['prefill_tokens_per_second']:,.0f} | "
              f"{100 * r['peak_fraction']:.1f}% |")
    if "itl" in results:
        print(f"\n{a.itl_rows} rows decoding at {a.itl_context} tokens, one {a.input_len}-token prompt arrives")
        print("| --max-num-batched-tokens | ITL before (median ms) | ITL max during prefill (ms) | "
              "decode steps during prefill | TTFT (s) | prefill step (mean ms) |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in results["itl"]:
            print(f"| {r['chunk']} | {r['itl_median_before_ms']:.1f} | {r['itl_max_during_ms']:.0f} | "
                  f"{r['decode_steps_during_prefill']} | {r['ttft_s']:.2f} | {r['prefill_step_ms_mean'] or 0:.0f} |")
    save()


if __name__ == "__main__":
    main()
