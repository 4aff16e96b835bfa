"""What loading a prefix from the prefix cache's host tier into GPU pages costs against
prefilling it (docs/prefix_caching.md), for a dense request, on the default model.

A sparse request (the document and 32 more tokens) runs first and finishes: the host tier holds
the document's blocks. The GPU tier's names are then dropped, and the document plus one token
(too short to go sparse) runs: its prefix is loaded, one token prefilled. The same request then
runs with the cache off (prefilled whole). Printed per document length: the load's time (the
copies alone), the request's TTFT with the load, and its TTFT prefilled, median of REPEATS.

    python scripts/host_tier_load_vs_prefill.py [--lengths 1024 2048] [--repeats 3] [--device cpu]
"""
from __future__ import annotations

import argparse
import statistics
import time

from oasiskv import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    two = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # converts after its prefill
    print(f"{'prefix tokens':>13} {'load (ms)':>10} {'TTFT loaded (ms)':>17} {'TTFT prefilled (ms)':>20}")
    for n in args.lengths:
        llm = LLM(max_model_len=n + 64, device=args.device, sparse=True, top_k_blocks=8, sparse_threshold=n + 16,
                  host_kv_gb=0.5, max_num_batched_tokens=n + 64)
        eng, bm = llm.engine, llm.engine.block_manager
        sparse = eng.runner.sparse
        doc = [(7 * j) % 3000 + 100 for j in range(n)]
        loads, loaded, prefilled = [], [], []
        timed = sparse.load_host_hits

        def timed_load(seqs):
            t0 = time.perf_counter()
            timed(seqs)
            if any(s.num_cached_tokens for s in seqs):
                loads.append(time.perf_counter() - t0)

        sparse.load_host_hits = timed_load
        for r in range(args.repeats + 1):  # the first round warms up
            bm.enable_caching = True
            bm.reset_prefix_cache()
            assert llm.generate([doc + list(range(200, 232))], two)[0].stats  # sparse: kept in the host tier
            tier, bm.host_tier = bm.host_tier, None
            bm.reset_prefix_cache()  # the GPU tier's names only
            bm.host_tier = tier
            hit = llm.generate([doc + [5]], one)[0]
            assert hit.num_host_cached_tokens == n and not hit.stats
            bm.reset_prefix_cache()
            bm.enable_caching = False
            cold = llm.generate([doc + [5]], one)[0]
            assert cold.token_ids == hit.token_ids
            if r:
                loaded.append(hit.metrics["ttft"])
                prefilled.append(cold.metrics["ttft"])
        ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
        print(f"{n:>13} {ms(loads[1:]):>10.1f} {ms(loaded):>17.1f} {ms(prefilled):>20.1f}")


if __name__ == "__main__":
    main()
