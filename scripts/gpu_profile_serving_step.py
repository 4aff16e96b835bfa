"""The serving engine's decode at N rows, end to end, in one process (no HTTP): how long a step
takes once every request is sparse, and where it goes (foreground, pipeline stall, host work,
bytes moved against the budget), for dense and for sparse under each transfer budget; then the
device's kernels over a few steady steps (torch profiler, by total time).

PYTHONPATH=. python3 scripts/gpu_profile_serving_step.py --rows 48 --context 5120 --cases dense off auto
--arrival N: then a prompt of N tokens arrives while the rows decode (its prefill chunks, the
decode steps between them, its conversion; with --trace the device's busy time over it).
Writes serving_step.json and profile_<case>_<rows>rows.txt under $OUT; --trace adds each case's
kernels per CUDA stream (the foreground's busy time against its span) to the JSON.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time
from collections import defaultdict

import torch

from oasiskv.config import EngineConfig
from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.kernels.block_bounds import BOUNDS_SKIP_DEAD_TILES as DEFAULT_SKIP_DEAD
from oasiskv.kernels.block_select import SELECT_DIGIT_BITS as DEFAULT_SELECT_BITS
from oasiskv.sampling_params import SamplingParams
from oasiskv.sparse.fetch_budget import STALL_TARGET as DEFAULT_STALL_TARGET
from oasiskv.sparse.pipeline import BOUNDS_PROGRAMS_PER_HEAD as DEFAULT_BOUNDS_PROGRAMS
from oasiskv.sparse.tuning import STAGE_FORKS, PipelineTuning


CASES_HELP = ("dense, or a --fetch-budget value (auto, off, MB); suffixes: /sN N attention splits, "
              "/tN transfer stream priority -N, /FN the stages fork after STAGE_FORKS[N] "
              "(attention, o_proj, mlp, epilogue), /cN the GEMMs' SM carve-out (c-1: torch's BLAS as it is), "
              "/hN candidates a budget-share program (h0: the two sorts), /e1 no CUDA graphs (the steps launched eagerly), "
              "/bN bounds-scan programs per (request, kv head) (default 3; fewer hold fewer SMs at once), "
              "/d0 the drafts' lookup as torch ops instead of one kernel, /u0 block summaries in the KV dtype, /u1 in fp8 (the default on CUDA), "
              "/pN only the first N stages run (p0: none, p1: predict, p2: + select; benchmarks only), "
              "/gN the top-K select's threshold search N bits a pass (1, 2 the default, 4; fewer on wide rows), "
              "/mN the auto budget's stall target N% (default 2; m100: the margin never moves), "
              "/x0 the bounds scan runs the tiles past each row's end (x1, the default: skips them), "
              "/rN the per-head cap at a fetch ratio of N% (r5, the default: C = 7 at K = 128)")


def timed(obj, name, into):
    original = getattr(obj, name)

    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        try:
            return original(*args, **kw)
        finally:
            into[name] += time.perf_counter() - t0
    setattr(obj, name, wrapper)


def trace_summary(path: str, steps: int) -> dict:
    """Per CUDA stream of a profiler trace: kernels, their summed time, the span they cover and
    the top kernels (per step)."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    streams = defaultdict(list)
    for e in events:
        streams[e["args"].get("stream")].append(e)
    out = {}
    for sid, evs in streams.items():
        busy = sum(e["dur"] for e in evs)
        span = max(e["ts"] + e["dur"] for e in evs) - min(e["ts"] for e in evs)
        out[str(sid)] = {"kernels_per_step": round(len(evs) / steps, 1), "busy_ms_per_step": round(busy / steps / 1e3, 3),
                         "span_ms": round(span / 1e3, 3)}
        by_name = defaultdict(float)
        for e in evs:
            by_name[e["name"][:60]] += e["dur"]
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
        out[str(sid)]["top_us_per_step"] = {k: round(v / steps, 1) for k, v in top}
        evs = sorted(evs, key=lambda e: e["ts"])
        waits = defaultdict(float)  # idle time before each kernel, by the kernel that waited
        for prev, e in zip(evs, evs[1:]):
            waits[e["name"][:60]] += max(0.0, e["ts"] - prev["ts"] - prev["dur"])
        top = sorted(waits.items(), key=lambda kv: -kv[1])[:5]
        out[str(sid)]["idle_before_us_per_step"] = {k: round(v / steps, 1) for k, v in top}
    busiest = max(streams, key=lambda sid: len(streams[sid]), default=None)
    if busiest is not None:
        out["foreground_gaps"] = gap_overlaps(streams, busiest, steps)
    # A graph's replay spreads one captured stream's kernels over several: totals by name say more.
    by_name = defaultdict(float)
    for e in events:
        by_name[e["name"][:60]] += e["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:16]
    return {"streams": out, "kernels_us_per_step": {k: round(v / steps, 1) for k, v in top}}


def gap_overlaps(streams: dict, fg, steps: int, min_gap_us: float = 5.0) -> dict:
    """What ran on the other streams while the foreground (`fg`, the stream with the most
    kernels) sat idle for at least `min_gap_us`: each other kernel's overlap with those gaps
    (us per step, top 8), and the gaps' total with nothing running anywhere."""
    evs = sorted(streams[fg], key=lambda e: e["ts"])
    gaps = [(a["ts"] + a["dur"], b["ts"]) for a, b in zip(evs, evs[1:]) if b["ts"] - a["ts"] - a["dur"] >= min_gap_us]
    others = sorted((e for sid, es in streams.items() if sid != fg for e in es), key=lambda e: e["ts"])
    overlap, empty = defaultdict(float), 0.0
    for g0, g1 in gaps:
        covered = []
        for e in others:
            if e["ts"] >= g1:
                break
            lo, hi = max(g0, e["ts"]), min(g1, e["ts"] + e["dur"])
            if hi > lo:
                overlap[e["name"][:60]] += hi - lo
                covered.append((lo, hi))
        end, busy = g0, 0.0  # union of the covered intervals
        for lo, hi in sorted(covered):
            if hi > end:
                busy += hi - max(lo, end)
                end = hi
        empty += (g1 - g0) - busy
    top = sorted(overlap.items(), key=lambda kv: -kv[1])[:8]
    return {"gaps_per_step": round(len(gaps) / steps, 1),
            "examples": gap_examples(streams, fg, gaps),
            "gap_us_per_step": round(sum(g1 - g0 for g0, g1 in gaps) / steps, 1),
            "nothing_running_us_per_step": round(empty / steps, 1),
            "overlapping_us_per_step": {k: round(v / steps, 1) for k, v in top}}


def gap_examples(streams: dict, fg, gaps: list, count: int = 3, before_us: float = 40.0) -> list:
    """A few foreground gaps from the middle of the trace, each with every kernel on any stream
    that ran from `before_us` before it to its end: (stream, start and end in us from the gap's
    start, name), to see what the foreground's next kernel started after."""
    out = []
    for g0, g1 in gaps[len(gaps) // 2:len(gaps) // 2 + count]:
        seen = sorted((e for es in streams.values() for e in es
                       if e["ts"] < g1 + 5 and e["ts"] + e["dur"] > g0 - before_us), key=lambda e: e["ts"])
        out.append({"gap_us": round(g1 - g0, 1),
                    "kernels": [(str(e["args"].get("stream")) + ("*" if e["args"].get("stream") == fg else ""),
                                 round(e["ts"] - g0, 1), round(e["ts"] + e["dur"] - g0, 1), e["name"][:40])
                                for e in seen]})
    return out


def measure_arrival(engine, prompt: list[int], params, sparse: bool, spent: dict, trace_dir: str | None,
                    name: str, max_steps: int = 1000) -> dict:
    """A prompt arrives while the rows decode: the engine steps until its first token (sparse:
    until it has converted, which follows at once), by kind, with their host-side wall time, the
    conversion's, and with `trace_dir` the device's kernels over the whole arrival (totals)."""
    from contextlib import nullcontext
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    stats0, convert0 = dict(engine.step_stats), spent["_convert_to_sparse"]
    rid = engine.add_request(prompt, params)
    seq = engine.seqs[rid]
    steps, first_step, first_token_s = 0, 0, None
    prof = profile(activities=[ProfilerActivity.CUDA]) if trace_dir else nullcontext()
    t0 = time.perf_counter()
    with prof:
        while steps < max_steps and engine.has_unfinished():
            engine.step()
            steps += 1
            if first_token_s is None and seq.output_token_ids:
                first_token_s = time.perf_counter() - t0
                first_step = steps
            if first_token_s is not None and (not sparse or seq.sparse is not None or steps - first_step >= 64):
                break  # (a request that stays dense 64 steps past its first token is reported unconverted)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    d = {k: engine.step_stats[k] - stats0.get(k, 0) for k in engine.step_stats}
    out = {"prompt": len(prompt), "first_token_s": round(first_token_s or 0.0, 3), "wall_s": round(wall, 3),
           "engine_steps": steps, "converted": seq.sparse is not None,
           "convert_s": round(spent["_convert_to_sparse"] - convert0, 3)}
    for kind in ("prefill", "decode"):
        n = d.get(f"{kind}_steps", 0)
        out[f"{kind}_steps"] = n
        out[f"{kind}_ms"] = round(1e3 * d.get(f"{kind}_time", 0.0) / max(n, 1), 2)  # host-side wall a step
    if trace_dir:
        path = os.path.join(trace_dir, f"trace_arrival_{name}.json")
        prof.export_chrome_trace(path)
        out["trace"] = trace_summary(path, 1)  # totals over the arrival: busy against the wall
        os.remove(path)
    return out


def pipeline_tuning(knobs: dict[str, int]) -> PipelineTuning:
    """The pipeline's tuning with a case's suffixes: s attention splits, t transfer priority -N,
    F the stages' fork (STAGE_FORKS[N]), p the stages that run (the foreground's cost without the
    rest), c the GEMMs' SM carve-out (negative: torch's BLAS settings as they are)."""
    changes = {}
    if "s" in knobs:
        changes["attention_splits"] = knobs["s"]
    if "t" in knobs:
        changes["transfer_priority"] = -knobs["t"]
    if "F" in knobs:
        changes["stages_fork"] = STAGE_FORKS[knobs["F"]]
    if "p" in knobs:
        changes["stages"] = knobs["p"]
    if "c" in knobs:
        changes["gemm_sm_carveout"] = knobs["c"] if knobs["c"] >= 0 else None
    return PipelineTuning(**changes)


def run_case(a, case: str, out_dir: str | None) -> dict:
    """case: dense, or a --fetch-budget value (auto, off, MB), optionally "/sN": N attention splits."""
    budget, *knobs = case.split("/")
    knobs = {k[0]: int(k[1:]) for k in knobs}
    sparse = budget != "dense"
    from oasiskv.sparse import pipeline as pipeline_module
    pipeline_module.BOUNDS_PROGRAMS_PER_HEAD = knobs.get("b", DEFAULT_BOUNDS_PROGRAMS)  # b: per (request, kv head)
    from oasiskv.sparse import device_drafts  # d0: the drafts' rule as torch ops
    device_drafts.LOOKUP_KERNEL = bool(knobs.get("d", 1))
    from oasiskv.kernels import budget_share  # h: candidates a share program takes (fewer programs)
    budget_share.SHARE_TILE_CANDIDATES = knobs.get("h", 64)
    from oasiskv.sparse import fetch_budget
    from oasiskv.kernels import block_bounds, block_select  # g: bits a pass of the select's threshold search
    block_select.SELECT_DIGIT_BITS = knobs.get("g", DEFAULT_SELECT_BITS)
    block_bounds.BOUNDS_SKIP_DEAD_TILES = bool(knobs.get("x", DEFAULT_SKIP_DEAD))
    fetch_budget.STALL_TARGET = knobs.get("m", DEFAULT_STALL_TARGET * 100) / 100  # m: the margin's stall target
    cfg = EngineConfig.from_flat(model=a.model, load_format="dummy", kv_cache_gb=a.kv_cache_gb, sparse=sparse,
                                 pipeline_tuning=pipeline_tuning(knobs),
                                 enforce_eager=bool(knobs.get("e", 0)),
                                 summary_dtype={None: "auto", 0: "kv"}.get(knobs.get("u"), "fp8"),
                                 sparse_threshold=a.threshold, host_kv_gb=a.host_kv_gb,
                                 fetch_budget=budget if sparse else "auto",
                                 **({"fetch_ratio": knobs["r"] / 100} if "r" in knobs else {}),  # r: per-head cap
                                 max_num_seqs=a.max_num_seqs or max(a.rows, 16),
                                 max_model_len=a.max_model_len or a.context + a.steps + 64)
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    row = {"case": case, "rows": a.rows, "context": a.context, "max_num_seqs": cfg.max_num_seqs,
           "max_model_len": cfg.max_model_len, "start_s": round(time.perf_counter() - t0, 1)}
    p = engine.runner.pipeline
    if p is not None:
        row["link_GBps"] = round(p.budget.link_bytes_per_s / 1e9, 1)
    spent = defaultdict(float)
    timed(engine.runner, "launch_decode", spent)
    timed(engine, "postprocess", spent)
    timed(engine, "_convert_to_sparse", spent)
    vocab = engine.runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=a.steps, ignore_eos=True, temperature=a.temperature)
    for _ in range(a.rows):
        engine.add_request(torch.randint(0, vocab, (a.context,), generator=gen).tolist(), params)
    # Until every request decodes (sparse: has converted): prefill, conversions, preemptions.
    t0, steps = time.perf_counter(), 0
    ready = lambda: (not engine.scheduler.waiting and all(  # noqa: E731
        not s.in_prefill and (not sparse or s.sparse is not None) for s in engine.scheduler.running))
    while engine.has_unfinished() and not ready() and steps < a.max_warm_steps:
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    row["warm_s"], row["warm_steps"] = round(time.perf_counter() - t0, 2), steps
    for _ in range(5):  # the sparse step's graph is built on its first use
        engine.step()
    torch.cuda.synchronize()
    row["converting_s"] = round(spent["_convert_to_sparse"], 2)
    m = engine.runner.sparse
    before = dict(m.totals) if m is not None else {}
    spent.clear()
    n, t0, tok0 = 0, time.perf_counter(), engine.step_stats["decode_tokens"]
    while engine.has_unfinished() and n < a.measure:
        engine.step()
        n += 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = engine.step_stats["decode_tokens"] - tok0
    row.update(engine_steps=n, period_ms=round(1e3 * wall / n, 3), launch_ms=round(1e3 * spent["launch_decode"] / n, 3),
               postprocess_ms=round(1e3 * spent["postprocess"] / n, 3),
               preemptions=engine.scheduler.num_preemptions if hasattr(engine.scheduler, "num_preemptions") else None)
    if m is not None:
        d = {k: m.totals[k] - before.get(k, 0) for k in m.totals}
        k = max(d["steps"], 1)
        row.update(sparse_steps=d["steps"], foreground_ms=round(1e3 * d["foreground_s"] / k, 3),
                   stall_ms=round(1e3 * d["stall_s"] / k, 3), MB_per_step=round(d["bytes"] / k / 1e6, 1),
                   budget_MB_per_step=round(d["budget_bytes"] / k / 1e6, 1),
                   hit_rate=round(d["hits"] / d["predicted"], 3) if d["predicted"] else None)
    row["tok_per_s"] = round(tokens / wall, 1)
    if out_dir and engine.has_unfinished():
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(a.profile_steps):
                if engine.has_unfinished():
                    engine.step()
            torch.cuda.synchronize()
        name = f"{case.replace('/', '_')}_{a.rows}rows"
        if a.trace:
            trace = os.path.join(out_dir, f"trace_{name}.json")
            prof.export_chrome_trace(trace)
            row["trace"] = trace_summary(trace, a.profile_steps)
            os.remove(trace)
        with open(os.path.join(out_dir, f"profile_{name}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
            f.write("\n\n")
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70))
    if a.arrival and engine.has_unfinished():
        prompt = torch.randint(0, vocab, (a.arrival,), generator=gen).tolist()
        row["arrival"] = measure_arrival(engine, prompt, params, sparse, spent,
                                         out_dir if a.trace else None, f"{case.replace('/', '_')}_{a.rows}rows")
    del tokens
    for s in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(s.request_id)
    while engine.has_unfinished():
        engine.step()
    del engine
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--rows", type=int, nargs="+", default=[48])
    ap.add_argument("--context", type=int, default=5120)
    ap.add_argument("--steps", type=int, default=400, help="max_tokens of each request")
    ap.add_argument("--measure", type=int, default=150, help="engine steps timed once every request decodes")
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--max-warm-steps", type=int, default=300, help="dense: requests the pool cannot hold wait")
    ap.add_argument("--kv-cache-gb", type=float, default=24)
    ap.add_argument("--host-kv-gb", type=float, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the rows (at least 16)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: context + steps + 64")
    ap.add_argument("--threshold", type=int, default=4096)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy, as `bench serve` sends")
    ap.add_argument("--cases", nargs="+", default=["dense", "off", "auto"],
                    help=CASES_HELP)
    ap.add_argument("--trace", action="store_true", help="summarize the profiled steps' kernels per CUDA stream")
    ap.add_argument("--arrival", type=int, default=0,
                    help="then a prompt of this many tokens arrives: the steps until its first token (and conversion)")
    a = ap.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s: %(message)s")  # conversions, graph builds
    out_dir = os.environ.get("OUT")
    rows = []
    for n in list(a.rows):
        a.rows = n
        for case in a.cases:
            rows.append(run_case(a, case, out_dir))
            print(json.dumps(rows[-1]), flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "serving_step.json"), "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
