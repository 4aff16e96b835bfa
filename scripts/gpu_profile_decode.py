"""Where a dense decode step's time goes: batch building, graph replay, logits + sampling.

PYTHONPATH=. python3 scripts/gpu_profile_decode.py [--model qwen3-8b] [--batch 16] [--context 1024]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from oasiskv.bench.roofline import HBM_BYTES_PER_S
from oasiskv.config import EngineConfig
from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.engine.sampler import sample
from oasiskv.models.step_bytes import kv_bytes_per_step, weight_bytes_per_step
from oasiskv.sampling_params import SamplingParams


def timed(fn, n=20):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--context", type=int, default=1024)
    a = ap.parse_args()
    rows = []
    engine = LLMEngine(EngineConfig(model=a.model, load_format="dummy", max_num_seqs=max(a.batch),
                                    max_model_len=a.context + 64))
    r = engine.runner
    mc = r.model_config
    for B in a.batch:
        params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
        for i in range(B):
            engine.add_request([(7 * i + j) % mc.vocab_size for j in range(a.context)], params)
        while any(s.in_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        seqs = list(engine.scheduler.running)[:B]
        step_ms = timed(lambda: engine.step(), n=10)
        prep_ms = timed(lambda: r.prepare_decode(seqs))
        bucket = min(b for b in r.graphs if b >= B)
        replay_ms = timed(lambda: r.graphs[bucket].replay())
        hidden = r.static["hidden"][:B]
        logits_ms = timed(lambda: r.model.compute_logits(hidden))
        logits = r.model.compute_logits(hidden)
        sample_ms = timed(lambda: sample(logits, [s.params for s in seqs], [None] * B).tolist())
        ctx = sum(s.num_tokens for s in seqs)
        floor = (weight_bytes_per_step(mc, 2) + kv_bytes_per_step(mc, 2, ctx)) / HBM_BYTES_PER_S * 1e3
        row = dict(batch=B, context=a.context, step_ms=step_ms, prepare_ms=prep_ms, graph_replay_ms=replay_ms,
                   logits_ms=logits_ms, sample_ms=sample_ms, roofline_floor_ms=floor)
        rows.append(row)
        print(json.dumps(row), flush=True)
        for s in list(engine.scheduler.running):
            engine.abort(s.request_id)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "decode_profile.json"), "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
