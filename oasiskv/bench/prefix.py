"""`oasiskv bench prefix`: what the prefix cache saves on loads that repeat a prefix, cache off then
on, in one engine (so both runs share weights, pool and captured graphs).

Two loads (vLLM's prefix-caching benchmark and multi-turn chat, in random token ids so dummy
weights work):

- shared-doc: N requests, all sent at once, each a D-token document (the same for all) and a
  Q-token question of its own; O tokens out each.
- multi-turn: C conversations at once, T turns each. A conversation's first turn is its own
  D-token document and a Q-token question; every later turn re-sends the whole history (the
  previous prompt and answer) and a new Q-token question, as a chat client does. A turn is sent
  when the conversation's previous one finishes.

Printed and written per (load, cache): mean and median TTFT, output tokens/s, the cache's hit
rate (prompt tokens found cached / looked up) per tier (GPU pages; the host tier of a sparse
engine), the prefill tokens computed, and whether the tokens equal the cache-off run's.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from oasiskv.entrypoints.args import engine_config

LOADS = ("shared-doc", "multi-turn")


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loads", nargs="+", choices=LOADS, default=list(LOADS))
    p.add_argument("--num-requests", type=int, default=32, help="shared-doc: requests")
    p.add_argument("--doc-len", type=int, default=16384, help="shared-doc: the document's tokens")
    p.add_argument("--question-len", type=int, default=256, help="tokens of each question")
    p.add_argument("--output-len", type=int, default=256, help="tokens out per request (each turn)")
    p.add_argument("--conversations", type=int, default=16, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--first-turn-len", type=int, default=13312,
                   help="multi-turn: the first turn's document tokens (the question comes on top)")
    p.add_argument("--cache", nargs="+", choices=["off", "on"], default=["off", "on"], help="runs, in order")
    p.add_argument("--control-chunk", type=int, default=None, metavar="TOKENS",
                   help="after the runs, the cache off again with prefill chunks of TOKENS: how many "
                        "requests keep the first cache-off run's tokens when only the chunking changes")
    p.add_argument("--output-json", default=None, help="write every run's figures here")


class Load:
    """The requests of one load, sent as the engine frees room: shared-doc sends all at once;
    multi-turn sends a conversation's next turn when its previous one finishes."""

    def __init__(self, name: str, args, vocab: int):
        rng = np.random.default_rng(args.seed)
        ids = lambda n: rng.integers(0, vocab, size=n).tolist()  # noqa: E731
        self.name, self.args = name, args
        if name == "shared-doc":
            doc = ids(args.doc_len)
            self.first = [doc + ids(args.question_len) for _ in range(args.num_requests)]
            self.questions: list[list[list[int]]] = [[] for _ in self.first]
        else:
            self.first = [ids(args.first_turn_len) + ids(args.question_len) for _ in range(args.conversations)]
            self.questions = [[ids(args.question_len) for _ in range(args.turns - 1)] for _ in self.first]

    def run(self, engine, params) -> list[dict]:
        """-> one record per request: conversation, turn, prompt length, TTFT, output token ids."""
        owner: dict[str, tuple[int, int, list[int]]] = {}  # request id -> (conversation, turn, prompt)
        for c, prompt in enumerate(self.first):
            owner[engine.add_request(prompt, params)] = (c, 0, prompt)
        records = []
        while engine.has_unfinished():
            for out in engine.step():
                if not out.finished:
                    continue
                c, turn, prompt = owner.pop(out.request_id)
                records.append({"conversation": c, "turn": turn, "prompt_len": len(prompt),
                                "ttft": out.metrics.get("ttft"), "cached_tokens": out.num_cached_tokens,
                                "host_cached_tokens": out.num_host_cached_tokens,
                                "token_ids": out.token_ids})
                if turn < len(self.questions[c]):  # its next turn
                    nxt = prompt + out.token_ids + self.questions[c][turn]
                    owner[engine.add_request(nxt, params)] = (c, turn + 1, nxt)
        return sorted(records, key=lambda r: (r["conversation"], r["turn"]))


class _NoHostTier:  # a dense engine's (no host tier): nothing looked up
    queries = hits = 0


def warm_up(engine) -> None:
    """One request long enough for a full prefill chunk (and a conversion, when sparse), so that
    kernels compile before either timed run."""
    from oasiskv.sampling_params import SamplingParams

    n = min(engine.config.max_num_batched_tokens + 64, engine.max_model_len - 8)
    if engine.runner.sparse is not None:
        n = min(max(n, engine.config.sparse.sparse_threshold + 64), engine.max_model_len - 8)
    n = min(n, (engine.block_manager.num_pages - 1) * engine.config.block_size)  # a small GPU pool's room
    engine.add_request(list(range(n)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def run_once(engine, load: Load, params, cache: str, chunk: int | None = None) -> dict:
    """One run of `load`; with `chunk`, prefill chunks of that many tokens (the cache off)."""
    bm = engine.block_manager
    bm.enable_caching = cache == "on"
    default_chunk = engine.scheduler.max_num_batched_tokens
    engine.scheduler.max_num_batched_tokens = chunk or default_chunk
    bm.reset_prefix_cache()
    st = engine.step_stats
    host = bm.host_tier or _NoHostTier
    before = dict(st, queries=bm.queries, hits=bm.hits, preemptions=engine.scheduler.num_preemptions,
                  conversions=engine.runner.sparse.num_conversions if engine.runner.sparse else 0,
                  host_queries=host.queries, host_hits=host.hits)
    start = time.perf_counter()
    try:
        records = load.run(engine, params)
    finally:
        engine.scheduler.max_num_batched_tokens = default_chunk
    duration = time.perf_counter() - start
    queries, hits = bm.queries - before["queries"], bm.hits - before["hits"]
    host_queries, host_hits = host.queries - before["host_queries"], host.hits - before["host_hits"]
    ttft = [r["ttft"] for r in records if r["ttft"] is not None]
    n_out = sum(len(r["token_ids"]) for r in records)
    return {
        "load": load.name, "cache": cache if chunk is None else f"off, chunks of {chunk}",
        "requests": len(records), "duration_s": duration,
        "mean_ttft_ms": 1e3 * float(np.mean(ttft)), "median_ttft_ms": 1e3 * float(np.median(ttft)),
        "p99_ttft_ms": 1e3 * float(np.percentile(ttft, 99)),
        "output_throughput": n_out / duration, "total_output_tokens": n_out,
        "total_prompt_tokens": sum(r["prompt_len"] for r in records),
        "prefill_tokens_computed": st["prefill_tokens"] - before["prefill_tokens"],
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "hit_rate": hits / queries if queries else 0.0,
        "prefix_cache_queries_host": host_queries, "prefix_cache_hits_host": host_hits,
        "host_hit_rate": host_hits / host_queries if host_queries else 0.0,
        "preemptions": engine.scheduler.num_preemptions - before["preemptions"],
        "conversions": (engine.runner.sparse.num_conversions if engine.runner.sparse else 0) - before["conversions"],
        "records": records,
    }


def compare(runs: list[dict]) -> None:
    """Each run's tokens against the cache-off run of the same load: the fraction of requests
    with equal outputs, and the TTFT and prefill ratios."""
    base = {}
    for r in runs:
        if r["cache"] == "off":
            base.setdefault(r["load"], r)
    for r in runs:
        ref = base.get(r["load"])
        if ref is None or ref is r:
            continue
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(ref["records"], r["records"]))
        r["tokens_equal_fraction"] = same / len(ref["records"])
        r["ttft_speedup"] = ref["mean_ttft_ms"] / r["mean_ttft_ms"]
        r["output_throughput_ratio"] = r["output_throughput"] / ref["output_throughput"]
        r["prefill_reduction"] = 1 - r["prefill_tokens_computed"] / ref["prefill_tokens_computed"]


def print_run(r: dict) -> None:
    line = lambda label, value, fmt="": print(f"{label:<40} {value:{fmt}}")  # noqa: E731
    print("{:=^60}".format(f" {r['load']}, prefix cache {r['cache']} "))
    line("Requests:", r["requests"])
    line("Duration (s):", r["duration_s"], ".2f")
    line("Mean TTFT (ms):", r["mean_ttft_ms"], ".1f")
    line("Median TTFT (ms):", r["median_ttft_ms"], ".1f")
    line("Output token throughput (tok/s):", r["output_throughput"], ".1f")
    line("Prefix cache hit rate, GPU tier (%):", 100 * r["hit_rate"], ".1f")
    if r["prefix_cache_queries_host"]:
        line("Host tier hit rate (%):", 100 * r["host_hit_rate"], ".1f")
    line("Prefill tokens computed:", r["prefill_tokens_computed"])
    line("Preemptions / conversions:", f"{r['preemptions']} / {r['conversions']}")
    if "tokens_equal_fraction" in r:
        line("TTFT, cache off / on:", r["ttft_speedup"], ".2f")
        line("Output throughput, on / off:", r["output_throughput_ratio"], ".2f")
        line("Prefill tokens saved (%):", 100 * r["prefill_reduction"], ".1f")
        line("Requests with the cache-off tokens (%):", 100 * r["tokens_equal_fraction"], ".1f")


def run_prefix_bench(args) -> int:
    from oasiskv.engine.llm_engine import LLMEngine
    from oasiskv.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(engine_config(args))
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm_up(engine)
    vocab = engine.runner.model_config.vocab_size
    runs = []
    result = {"model": engine.runner.model_config.name, "dtype": str(engine.runner.dtype).removeprefix("torch."),
              "device": engine.runner.device.type, "sparse": engine.runner.sparse is not None,
              "load_seconds": load_s, "args": {k: v for k, v in vars(args).items() if k != "func"}, "runs": runs}
    for name in args.loads:
        load = Load(name, args, vocab)
        plan = [(cache, None) for cache in args.cache]
        if args.control_chunk:
            plan.append(("off", args.control_chunk))
        for cache, chunk in plan:
            runs.append(run_once(engine, load, params, cache, chunk))
            compare(runs)
            print_run(runs[-1])
            if args.output_json:  # after every run, so a cut-short call keeps what finished
                with open(args.output_json, "w") as f:
                    json.dump(result, f, indent=1)
    return 0
