"""Where the host's time goes under async scheduling: is a decode step bound by the device or
by the host? Per engine step: launching the next step (batch building + graph replay + sampling
launches), waiting for this step's tokens, post-processing, and the caller's loop.

PYTHONPATH=. python3 scripts/gpu_profile_async.py [--batch 16 256] [--context 1024] [--steps 64]
If the wait is near zero, the host is the bottleneck; if it is most of the step, the device is.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch

from oasiskv.bench.roofline import HBM_BYTES_PER_S
from oasiskv.config import EngineConfig
from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.sampling_params import SamplingParams


def timing(obj, name, into):
    original = getattr(obj, name)

    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return original(*args, **kw)
        finally:
            into[name] += time.perf_counter() - t0
    setattr(obj, name, timed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    a = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=a.model, load_format="dummy", max_num_seqs=max(a.batch),
                                    max_model_len=a.context + a.steps + 16, async_scheduling="on"))
    spent = defaultdict(float)
    for name in ("launch_decode", "prepare_decode"):
        timing(engine.runner, name, spent)
    for name in ("postprocess", "_next_step_of", "make_output"):
        timing(engine, name, spent)
    rows = []
    vocab = engine.runner.model_config.vocab_size
    for B in a.batch:
        params = SamplingParams(temperature=a.temperature, max_tokens=a.steps, ignore_eos=True)
        for i in range(B):
            engine.add_request([(7 * i + j) % vocab for j in range(a.context)], params)
        while any(s.in_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        torch.cuda.synchronize()
        spent.clear()
        st0 = dict(engine.step_stats)
        n, in_step, t0 = 0, 0.0, time.perf_counter()
        while engine.has_unfinished() and n < a.steps - 4:
            s0 = time.perf_counter()
            engine.step()
            in_step += time.perf_counter() - s0
            n += 1
        wall = time.perf_counter() - t0
        st = engine.step_stats
        steps = st["decode_steps"] - st0["decode_steps"]
        bytes_ = (st["decode_bytes"] - st0["decode_bytes"]) / max(steps, 1)
        ms = lambda x: round(1e3 * x / n, 3)
        row = dict(batch=B, context=a.context, engine_steps=n, period_ms=ms(wall),
                   launch_ms=ms(spent["launch_decode"]), prepare_ms=ms(spent["prepare_decode"]),
                   postprocess_ms=ms(spent["postprocess"]), make_output_ms=ms(spent["make_output"]),
                   next_step_of_ms=ms(spent["_next_step_of"]), outside_step_ms=ms(wall - in_step),
                   wait_and_rest_ms=ms(in_step - spent["launch_decode"] - spent["postprocess"]
                                       - spent["_next_step_of"]),
                   overlapped=st["overlapped_steps"] - st0["overlapped_steps"],
                   floor_ms=round(1e3 * bytes_ / HBM_BYTES_PER_S, 3))
        row["roofline"] = round(row["floor_ms"] / row["period_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        for s in list(engine.scheduler.running):
            engine.abort(s.request_id)
        while engine.has_unfinished():
            engine.step()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "async_profile.json"), "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
