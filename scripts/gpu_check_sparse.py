"""Check the sparse-decode building blocks on a GPU, then time them.

    PYTHONPATH=. python3 scripts/gpu_check_sparse.py [--quick]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 scripts/gpu_check_sparse.py --cpu-smoke  # dry run

Checks: the kernel's per-head bounds (head_bounds_triton vs head_bounds_ref) and the combined
scores of every combine (score_blocks_triton vs score_blocks_ref) in bf16 (and fp16) at
realistic shapes (16 seqs, Hq=32, Hkv=8, D=128, up to 2048 blocks, ragged; with and without
sink/window exclusion), pass when the error is < 1e-5 of the largest |bound| (bf16 inputs are
exact in fp32, only the summation order differs), every bound was written, and the top-K sets
equal the reference's up to near-ties; CUDA-graph replays of score_topk + capped_eviction and of
update_block_minmax after the inputs change in place, against eager results.
Timing (triton.testing.do_bench, median, CUDA-graph replays): the bounds kernel over its
tiling (blocks per tile, tiles per program, stages, warps), as GB/s of summary bytes read vs
the 4.25 TB/s copy (oasiskv/bench/roofline.py), then at the default tiling the scores, top-K, the fused select,
torch.topk alone and the torch path; capped_eviction at R = 16 x 8 rows, K = 128,
C = 7, eager and in a graph. The table goes to stdout and, if $OUT is set, $OUT/sparse.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

from oasiskv.bench.roofline import HBM_BYTES_PER_S
from oasiskv.kernels import block_bounds, block_select
from oasiskv.kernels.block_bounds import COMBINES, head_bounds_triton, score_blocks_triton
from oasiskv.kernels.block_select import score_select_triton
from oasiskv.kernels.summary_fold import FP8, to_summary
from oasiskv.sparse.block_scores import (head_bounds_ref, score_blocks_ref, score_blocks_torch, score_topk_triton,
                                         topk_blocks)
from oasiskv.sparse.capped_eviction import capped_eviction
from oasiskv.sparse.pipeline import bounds_tiling

PEAK_TBS = HBM_BYTES_PER_S / 1e12
HQ, HKV, D = 32, 8, 128  # Qwen3-8B attention heads
G = HQ // HKV
DEV = "cuda"
results = {"checks": [], "score_table": [], "eviction": []}


def record(name, ok, **info):
    results["checks"].append(dict(name=name, ok=bool(ok), **info))
    print(f"{'PASS' if ok else 'FAIL'} {name:<52} " + " ".join(f"{k} {v}" for k, v in info.items()))


def guarded(check, *args, **kw):
    try:
        check(*args, **kw)
    except Exception as e:  # noqa: BLE001
        record(f"{check.__name__}{args}{kw}", False, error=repr(e)[:400])


def score_inputs(R, max_blocks, dtype, seed=0, hkv=HKV, g=G, d=D, fp8=False):
    """Ragged sequences (one of max_blocks, one of 1, the rest in [max/2, max]) packed into one
    global summary tensor with a gap block after each; real min/max pairs (kmin <= kmax);
    fp8: the summaries in e4m3 (`--summary-dtype fp8`), the queries in dtype."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    nb = torch.randint(max_blocks // 2, max_blocks + 1, (R,), device=DEV, generator=gen)
    nb[0] = max_blocks
    if R > 1:
        nb[1] = 1
    nb = nb.int()
    off = (torch.cumsum(nb + 1, 0) - nb - 1).int()
    total = int((nb + 1).sum())
    a = torch.randn(total, hkv, d, device=DEV, generator=gen)
    b = torch.randn(total, hkv, d, device=DEV, generator=gen)
    kmin, kmax = torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype)
    if fp8:
        kmin, kmax = to_summary(kmin, FP8), to_summary(kmax, FP8)
    q = torch.randn(R, hkv * g, d, device=DEV, generator=gen).to(dtype)
    return q, kmin, kmax, off, nb


def score_err(out, ref, scale):
    """Max |out - ref| over finite entries / scale (the largest |bound|), and whether the -inf
    patterns agree."""
    same_inf = torch.equal(torch.isneginf(out), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    err = ((out - ref).abs()[fin].max() / scale).item() if fin.any() else 0.0
    return err, same_inf


def topk_mismatches(ids, ref, k, rel_tol=1e-4):
    """Rows whose top-K set differs from the reference's beyond near-ties at the K-th score."""
    ref_ids, ref_vals = topk_blocks(ref, k)
    ids, ref_ids, ref_vals, ref = ids.cpu(), ref_ids.cpu(), ref_vals.cpu(), ref.cpu()
    scale = ref[torch.isfinite(ref)].abs().max().item()
    bad = 0
    for r in range(ids.shape[0]):
        for h in range(ids.shape[1]):
            a = {i for i in ids[r, h].tolist() if i >= 0}
            b = {i for i in ref_ids[r, h].tolist() if i >= 0}
            kth = ref_vals[r, h, len(b) - 1].item() if b else 0.0
            if len(a) != len(b) or any(abs(ref[r, h, i].item() - kth) > rel_tol * scale for i in a ^ b):
                bad += 1
    return bad


def check_scores(R, max_blocks, k, dtype, window=False, tile=64, **shape):
    q, kmin, kmax, off, nb = score_inputs(R, max_blocks, dtype, seed=max_blocks + k, **shape)
    kw = {}
    if window:  # sinks 0..3 and a 4-block window left out of the ranking
        kw = dict(num_sink=4, window_start=(nb - 4).clamp_min(0).int())
    g = shape.get("g", G)
    name = (f"{str(dtype)[6:]}{' fp8-summaries' if shape.get('fp8') else ''} R{R} M{max_blocks} k{k} "
            f"{ {k: v for k, v in shape.items() if k != 'fp8'} or ''}{' sink+window' if window else ''}")
    # fp8: the kernel splits the query into two e4m3 parts (~2^-8 relative), not exact products
    tol, tie = (1e-2, 1e-2) if shape.pop("fp8", False) else (1e-5, 1e-4)
    u = torch.full((R, q.shape[1], max_blocks), float("nan"), device=q.device)
    head_bounds_triton(q, kmin, kmax, off, nb, g, max_blocks, block_tile=tile, out=u, **kw)
    ref_u = head_bounds_ref(q, kmin, kmax, off, nb, g, max_blocks, **kw)
    written = not u.isnan().any().item()
    scale = ref_u[torch.isfinite(ref_u)].abs().max().item()
    err, same_inf = score_err(torch.where(u.isnan(), 0.0, u), ref_u, scale)
    record(f"bounds {name}", err < tol and same_inf and written,
           rel_err=f"{err:.1e}", inf_pattern=same_inf, written=written)
    for combine in COMBINES:
        out = score_blocks_triton(q, kmin, kmax, off, nb, g, max_blocks, block_tile=tile,
                                  combine=combine, **kw)
        ref = score_blocks_ref(q, kmin, kmax, off, nb, g, max_blocks, combine=combine, **kw)
        err, same_inf = score_err(out, ref, scale)
        ids, _ = score_topk_triton(q, kmin, kmax, off, nb, g, k, max_blocks, block_tile=tile,
                                   combine=combine, **kw)
        bad = topk_mismatches(ids, ref, k, tie)
        record(f"scores {combine} {name}", err < tol and same_inf and bad == 0,
               rel_err=f"{err:.1e}", inf_pattern=same_inf, topk_rows_differ=bad)
    # The pipeline's fused combine + select: the same set as top-K, each id with its score.
    ref = score_blocks_ref(q, kmin, kmax, off, nb, g, max_blocks, **kw)
    ids, vals = score_select_triton(q, kmin, kmax, off, nb, g, k, max_blocks, block_tile=tile, **kw)
    bad = topk_mismatches(ids, ref, k, tie)
    paired = torch.where(ids >= 0, ref.gather(2, ids.long().clamp_min(0)), vals)
    vals_ok = bool(torch.allclose(paired, vals, rtol=1e-5, atol=tol * scale)) and bool(
        ((ids < 0) == (vals == float("-inf"))).all())
    record(f"select {name}", bad == 0 and vals_ok, topk_rows_differ=bad, vals_match_scores=vals_ok)


def eviction_inputs(R, K, P, num_blocks, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    resident = torch.rand(R, num_blocks, device=DEV, generator=gen).argsort(1)[:, :K].int() + 4
    last = torch.randint(0, 50, (R, K), device=DEV, generator=gen)
    predicted = torch.rand(R, num_blocks + 8, device=DEV, generator=gen).argsort(1)[:, :P].int()
    window_start = torch.full((R,), num_blocks + 4, device=DEV, dtype=torch.int32)
    return resident, last, predicted, window_start


def check_graph_replay(R=16, max_blocks=512, k=64, cap=7):
    """score_topk + capped_eviction captured once; new queries, lengths and working set copied
    in place; the replay must equal an eager run on the new values."""
    q, kmin, kmax, off, nb = score_inputs(R, max_blocks, torch.bfloat16)
    resident, last, _, _ = eviction_inputs(R * HKV, k, k, max_blocks - 8)
    window_start = (nb - 2).clamp_min(0).int()
    step = torch.tensor(51, device=DEV)

    def pipeline():
        ids, _ = score_topk_triton(q, kmin, kmax, off, nb, G, k, max_blocks, num_sink=2,
                                   window_start=window_start)
        ws_rows = window_start.repeat_interleave(HKV)
        return capped_eviction(resident, last, ids.view(R * HKV, k), 2, ws_rows, cap, step)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        pipeline()  # warm up (compile) off the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan_static = pipeline()
    # New contents in place; lengths shrink at random so the offsets stay valid.
    q.copy_(torch.randn_like(q))
    a, b = torch.randn_like(kmin), torch.randn_like(kmin)
    kmin.copy_(torch.minimum(a, b)), kmax.copy_(torch.maximum(a, b))
    nb.copy_((torch.rand(R, device=DEV) * nb).int() + 1)
    window_start.copy_((nb - 2).clamp_min(0))
    r2, l2, _, _ = eviction_inputs(R * HKV, k, k, max_blocks - 8, seed=3)
    resident.copy_(r2), last.copy_(l2), step.fill_(52)
    graph.replay()
    torch.cuda.synchronize()
    eager = pipeline()
    same = all(torch.equal(getattr(plan_static, f), getattr(eager, f)) for f in
               ("resident", "last_selected", "admit_blocks", "admit_slots", "hits", "admitted"))
    record(f"graph replay score_topk + capped_eviction R{R} M{max_blocks} k{k}", same,
           admitted_total=int(eager.admitted.sum()))


def check_summaries_graph(R=64, total=4096, dtype=torch.bfloat16, key_dtype=None):
    """update_block_minmax captured once, replayed on new rows: equal to an eager update (the
    pipeline's own fold, inside the qkv epilogue, is checked in gpu_check_kernels.py)."""
    from oasiskv.kernels.summary_fold import update_block_minmax
    kmin = to_summary(torch.randn(total, HKV, D, device=DEV) * 100, dtype)  # fp8: some past ±448
    kmax = to_summary(kmin.float() + 1, dtype)
    ids = torch.randperm(total, device=DEV)[:R]
    ids[-1] = -1  # a padding row
    keys = (torch.randn(R, HKV, D, device=DEV) * 100).to(key_dtype or dtype)
    first = torch.rand(R, device=DEV) < 0.3
    work = (kmin.clone(), kmax.clone())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        update_block_minmax(*work, ids, keys, first)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        update_block_minmax(*work, ids, keys, first)
    ids.copy_(torch.randperm(total, device=DEV)[:R]), keys.copy_(torch.randn_like(keys, dtype=torch.float) * 100)
    first.bernoulli_(0.5)
    work[0].copy_(kmin), work[1].copy_(kmax)
    graph.replay()
    update_block_minmax(kmin, kmax, ids, keys, first)
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731  (fp8: no eq)
    name = f"{str(dtype)[6:]}{' keys ' + str(key_dtype)[6:] if key_dtype else ''} R{R}"
    record(f"graph replay update_block_minmax {name}", same(work[0], kmin) and same(work[1], kmax))


def bench(fn, graph=True):
    import triton
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # us


def run_timings(R=16, max_blocks=2048, k=128, sweep=True):
    q, kmin, kmax, off, nb = score_inputs(R, max_blocks, torch.bfloat16)
    nb.fill_(max_blocks)  # every sequence full: the bytes are exactly R * Hkv * M * 2 * D * 2
    nbytes = R * HKV * max_blocks * 2 * D * kmin.element_size()
    print(f"\nscore_topk, R={R} seqs, Hq={HQ} Hkv={HKV} D={D} bf16, {max_blocks} blocks each, "
          f"k={k}; summaries {nbytes / 1e6:.1f} MB")
    print(f"{'what':<34} {'us':>8} {'GB/s':>8} {'of 4.25TB/s':>11}")
    out = torch.empty(R, HKV, max_blocks, device=DEV)
    bounds = torch.empty(R, HQ, max_blocks, device=DEV)
    rows = []
    # The bounds kernel across its tiling (the library's default: 64-block tiles, 8 a program,
    # 3 stages, 4 warps), then the scoring paths at the default.
    tilings = itertools.product((64, 128), (1, 2, 4, 8), (1, 2, 3), (4, 8)) if sweep else [(64, 8, 3, 4)]
    for tile, tpp, stages, warps in tilings:
        cfg = dict(block_tile=tile, tiles_per_program=tpp, stages=stages, num_warps=warps)
        rows.append((f"bounds t{tile} x{tpp} s{stages} w{warps}", bench(lambda: head_bounds_triton(
            q, kmin, kmax, off, nb, G, max_blocks, out=bounds, **cfg)), cfg))
    rows.append(("scores (bounds + combine)", bench(lambda: score_blocks_triton(
        q, kmin, kmax, off, nb, G, max_blocks, out=out)), {}))
    rows.append((f"scores + torch.topk, k={k}", bench(lambda: topk_blocks(score_blocks_triton(
        q, kmin, kmax, off, nb, G, max_blocks, out=out), k)), {}))
    rows.append(("scores + topk, combine=sum", bench(lambda: score_topk_triton(
        q, kmin, kmax, off, nb, G, k, max_blocks, combine="sum")), {}))
    rows.append((f"torch.topk only, k={k}", bench(lambda: topk_blocks(out, k)), {}))
    sel = (torch.empty(R * HKV, k, dtype=torch.int32, device=DEV), torch.empty(R * HKV, k, device=DEV))
    rows.append((f"fused select, k={k}", bench(lambda: score_select_triton(
        q, kmin, kmax, off, nb, G, k, max_blocks, out=sel)), {}))
    for kk in (64, 256):
        rows.append((f"scores + topk, k={kk}", bench(lambda: score_topk_triton(
            q, kmin, kmax, off, nb, G, kk, max_blocks)), {}))
    rows.append(("torch path (score_blocks_torch+topk)", bench(lambda: topk_blocks(
        score_blocks_torch(q, kmin, kmax, off, nb, G, max_blocks), k)), {}))
    # fp8 summaries: half the bytes, straight to fp8 tensor-core products (the query split in two).
    kmin8, kmax8 = to_summary(kmin, FP8), to_summary(kmax, FP8)
    for tile, tpp, stages in ((64, 8, 3), (64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 16, 3)):
        cfg = dict(block_tile=tile, tiles_per_program=tpp, stages=stages, num_warps=4)
        rows.append((f"bounds fp8 t{tile} x{tpp} s{stages} w4", bench(lambda: head_bounds_triton(
            q, kmin8, kmax8, off, nb, G, max_blocks, out=bounds, **cfg)), dict(cfg, summary_bytes=nbytes // 2)))
    sel = (torch.empty(R * HKV, k, dtype=torch.int32, device=DEV), torch.empty(R * HKV, k, device=DEV))
    rows.append((f"fused select fp8, k={k}", bench(lambda: score_select_triton(
        q, kmin8, kmax8, off, nb, G, k, max_blocks, out=sel)), dict(summary_bytes=nbytes // 2)))
    default = block_select.SELECT_DIGIT_BITS, block_select.SELECT_MAX_COMPARES
    block_select.SELECT_MAX_COMPARES = 1 << 30
    for bits in (1, 2, 4, 8):  # the select's threshold search, this many bits a pass on any row
        block_select.SELECT_DIGIT_BITS = bits
        rows.append((f"fused select fp8, k={k}, {bits} bits", bench(lambda: score_select_triton(
            q, kmin8, kmax8, off, nb, G, k, max_blocks, out=sel)), dict(summary_bytes=nbytes // 2)))
    block_select.SELECT_DIGIT_BITS, block_select.SELECT_MAX_COMPARES = default
    # Rows 60% full (a server's rows past half a scan width), the pipeline's tiling: the bounds
    # with the tiles past each row's end computed and skipped.
    part = torch.full_like(nb, int(0.6 * max_blocks))
    tile, tpp, stages = bounds_tiling(max_blocks)
    default_skip = block_bounds.BOUNDS_SKIP_DEAD_TILES
    for skip in (False, True):
        block_bounds.BOUNDS_SKIP_DEAD_TILES = skip
        rows.append((f"bounds fp8, rows 60%, skip dead {int(skip)}", bench(lambda: head_bounds_triton(
            q, kmin8, kmax8, off, part, G, max_blocks, out=bounds, block_tile=tile, tiles_per_program=tpp,
            stages=stages)), dict(summary_bytes=int(0.6 * nbytes) // 2)))
    block_bounds.BOUNDS_SKIP_DEAD_TILES = default_skip
    for name, us, cfg in rows:
        gbs = cfg.get("summary_bytes", nbytes) / us / 1e3 if "topk only" not in name else float("nan")
        results["score_table"].append(dict(what=name, rows=R, blocks=max_blocks, us=round(us, 1),
                                           GB_s=round(gbs, 1), **cfg))
        print(f"{name:<34} {us:>8.1f} {gbs:>8.0f} {gbs / (PEAK_TBS * 1e3):>11.1%}")

    Rr, K, C = R * HKV, 128, 7
    resident, last, predicted, ws = eviction_inputs(Rr, K, K, 2000)
    step = torch.tensor(60, device=DEV)
    print(f"\ncapped_eviction, R={Rr} rows, K={K}, C={C}")
    for mode in ("eager", "graph"):
        us = bench(lambda: capped_eviction(resident, last, predicted, 4, ws, C, step),
                   graph=mode == "graph")
        results["eviction"].append(dict(mode=mode, R=Rr, K=K, C=C, us=round(us, 1)))
        print(f"{mode:<8} {us:>8.1f} us")


def cpu_smoke():
    """Tiny shapes on CPU under TRITON_INTERPRET=1: the script's logic, not the GPU numbers."""
    global DEV
    DEV = "cpu"
    check_scores(3, 40, 8, torch.float16, tile=16, hkv=2, g=4, d=64)
    check_scores(3, 40, 8, torch.float32, window=True, tile=16, hkv=2, g=4, d=64)
    check_scores(3, 40, 8, torch.float16, tile=16, hkv=2, g=4, d=64, fp8=True)
    resident, last, predicted, ws = eviction_inputs(8, 16, 16, 64)
    plan = capped_eviction(resident, last, predicted, 4, ws, 7, 60)
    record("capped_eviction cpu smoke", bool((plan.admitted <= 7).all()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="checks only, no timing")
    ap.add_argument("--cpu-smoke", action="store_true", help="dry run at tiny shapes on CPU")
    ap.add_argument("--no-sweep", action="store_true", help="time the bounds kernel at its default tiling only")
    opts = ap.parse_args()
    if opts.cpu_smoke:
        cpu_smoke()
    else:
        print(torch.cuda.get_device_name(), "torch", torch.__version__)
        for dtype in (torch.bfloat16, torch.float16):
            guarded(check_scores, 16, 2048, 128, dtype)
        guarded(check_scores, 16, 2048, 128, torch.bfloat16, window=True)
        guarded(check_scores, 16, 2048, 64, torch.bfloat16, tile=128)
        guarded(check_scores, 5, 300, 32, torch.bfloat16, hkv=4, g=3, d=64)  # ragged last tile
        guarded(check_scores, 16, 2048, 128, torch.bfloat16, fp8=True)
        guarded(check_scores, 16, 2048, 128, torch.bfloat16, window=True, fp8=True)
        guarded(check_graph_replay)
        guarded(check_summaries_graph)
        guarded(check_summaries_graph, dtype=FP8, key_dtype=torch.bfloat16)
    n_fail = sum(not c["ok"] for c in results["checks"])
    try:
        if not (opts.quick or opts.cpu_smoke):
            run_timings(sweep=not opts.no_sweep)
            run_timings(R=24, max_blocks=1024, sweep=False)  # the serving step's rows at 8-16K
    finally:
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "sparse.json"), "w") as f:
                json.dump(results, f, indent=1)
    print(f"\n{len(results['checks']) - n_fail}/{len(results['checks'])} checks passed")
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
