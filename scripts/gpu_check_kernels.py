"""Check the Triton attention kernels against their references on a GPU, then time the
decode kernel as a fraction of the HBM byte roofline.

    PYTHONPATH=. python3 scripts/gpu_check_kernels.py [--quick] [--sweep]

Checks (bf16, fp16, fp32): the fused qkv epilogue (norm, RoPE, K/V store, summary fold) vs its
reference; paged_decode_triton vs paged_decode_ref at small shapes and vs paged_decode_torch at
realistic ones (B=16, Hkv=8, G=4, D=128, contexts 1K/16K/32K); each passes when
||out - ref|| / ||ref|| < 1e-2 (bf16) and every output element was written (outputs are
NaN-poisoned first); a CUDA-graph replay after the lengths and slot contents change. Timing: CUDA-graph replays under triton.testing.do_bench
(median, L2 flushed between runs) at B in {1, 16, 64}, contexts {4K, 16K, 32K}, Qwen3-8B heads
(Hq=32, Hkv=8, D=128, bf16). The table goes to stdout and, if $OUT is set, $OUT/kernels.json.
The fraction is of the 4.25 TB/s device copy (read + write); a read-only stream can pass 100%.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

from oasiskv.bench.roofline import HBM_BYTES_PER_S
from oasiskv.kernels.paged_decode import choose_num_splits, paged_decode_torch, paged_decode_triton
from oasiskv.kernels.reference import paged_decode_ref

PEAK_TBS = HBM_BYTES_PER_S / 1e12
BS, HQ, HKV, D = 16, 32, 8, 128  # Qwen3-8B attention heads
WORKING_SET_TOKENS = (1 + 128 + 4) * BS  # a sparse request's working set per (layer, kv head)
DEV = "cuda"
results = {"checks": [], "sweep": [], "table": []}


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def decode_inputs(B, Hkv, G, Q, max_blocks, dtype, lens, pool=None, seed=0, d=D):
    """Random inputs; slots scattered over the pool by randperm, unused table entries -1."""
    torch.manual_seed(seed)
    if pool is None:
        pool = torch.randn(B * Hkv * max_blocks + 11, 2, BS, d, device=DEV, dtype=dtype)
    n = B * Hkv * max_blocks
    slot_tables = torch.randperm(pool.shape[0], device=DEV)[:n].view(B, Hkv, max_blocks).int()
    cache_lens = torch.as_tensor(lens, device=DEV).view(B, Hkv).int()
    used = (cache_lens[:, :, None] + BS - 1) // BS
    slot_tables[torch.arange(max_blocks, device=DEV)[None, None] >= used] = -1
    q = torch.randn(B, Q, G * Hkv, d, device=DEV, dtype=dtype)
    k_new = torch.randn(B, Q, Hkv, d, device=DEV, dtype=dtype)
    v_new = torch.randn(B, Q, Hkv, d, device=DEV, dtype=dtype)
    return q, k_new, v_new, pool, slot_tables, cache_lens


def random_lens(B, Hkv, ctx):
    """Lengths in [ctx/2, ctx], with one empty list, one of 1 token and one full list."""
    lens = torch.randint(ctx // 2, ctx + 1, (B * Hkv,))
    lens[0], lens[-1] = 0, ctx
    if lens.numel() > 2:
        lens[1] = 1
    return lens


def guarded(check, *args, **kw):
    """Run one check; an exception is a recorded failure, not the end of the script."""
    try:
        check(*args, **kw)
    except Exception as e:  # noqa: BLE001
        results["checks"].append({"name": f"{check.__name__}{args}{kw}", "error": repr(e)[:500], "ok": False})
        print(f"FAIL {check.__name__}{args}{kw}: {e!r}"[:600])


def record(name, err, tol, written=True):
    ok = err < tol and written
    results["checks"].append({"name": name, "rel_err": err, "tol": tol, "written": written, "ok": ok})
    print(f"{'PASS' if ok else 'FAIL'} {name:<48} rel_err {err:.2e} (tol {tol:.0e})"
          + ("" if written else " UNWRITTEN OUTPUT"))


def check_decode(B, Hkv, G, Q, ctx, dtype, big=False, d=D, **kw):
    max_blocks = (ctx + BS - 1) // BS
    args = decode_inputs(B, Hkv, G, Q, max_blocks, dtype, random_lens(B, Hkv, ctx), seed=ctx + G, d=d)
    out = torch.full_like(args[0], float("nan"))  # poison: every element must be written
    paged_decode_triton(*args, d ** -0.5, out=out, **kw)
    ref = (paged_decode_torch if big else paged_decode_ref)(*args, d ** -0.5)
    tol = 1e-2 if dtype == torch.bfloat16 else 3e-3
    name = f"decode {str(dtype)[6:]} B{B} Hkv{Hkv} G{G} Q{Q} D{d} ctx{ctx}" + (f" {kw}" if kw else "")
    record(name, rel_err(out.nan_to_num(1e4), ref), tol, not out.isnan().any().item())


def check_qkv_epilogue(dtype, fold=None, norm=True, R=16, Q=2):
    """The fused epilogue against its reference (the separate torch functions) at Qwen3-8B's
    heads: q and k, the stored cache, and (fold "kv" | "fp8") the summaries and draft copy."""
    from oasiskv.kernels.qkv_epilogue import SummaryFold, qkv_epilogue, qkv_epilogue_ref
    from oasiskv.layers.rotary import RotaryEmbedding
    from oasiskv.kernels.summary_fold import update_block_minmax

    T, NB = R * Q, 4 * R
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, device=DEV, dtype=dtype)
    rot = RotaryEmbedding(D, 40960, 1e6, None).to(DEV)
    pos = torch.randint(0, 40960, (T,), device=DEV)
    qw, kw = ((1 + 0.1 * torch.randn(D, device=DEV)).to(dtype) for _ in range(2)) if norm else (None, None)
    pool = torch.randn(T * HKV + 5, 2, BS, D, device=DEV, dtype=dtype)
    slots = torch.randperm(pool.shape[0], device=DEV)[:T * HKV].view(T, HKV).int()
    if Q > 1:
        slots[1::Q] = -1  # draft rows are not stored
    offsets = torch.randint(0, BS, (T,), device=DEV).int()
    folds = [None, None]
    if fold:
        sd = torch.float8_e4m3fn if fold == "fp8" else dtype
        lo = torch.randn(NB, HKV, D, device=DEV)
        blocks = torch.randperm(NB, device=DEV)[:R]
        blocks[0] = -1
        first = torch.rand(R, device=DEV) < 0.5
        folds = [SummaryFold(lo.to(sd), (lo + lo.abs()).to(sd), blocks, first, Q,
                             torch.full((R, HQ, D), float("nan"), device=DEV, dtype=dtype), 1) for _ in range(2)]
    ref_pool = pool.clone()
    want = qkv_epilogue_ref(qkv, HQ, HKV, pos, rot.cos, rot.sin, qw, kw, 1e-6, ref_pool, slots, offsets)
    got = qkv_epilogue(qkv, HQ, HKV, pos, rot.cos, rot.sin, qw, kw, 1e-6, pool, slots, offsets, folds[1])
    if fold:  # torch folds the kernel's own keys: one a rounding step off may cross an fp8 grid point
        f = folds[0]
        update_block_minmax(f.kmin, f.kmax, f.block_ids, got[1][0::Q], f.first_in_block)
        f.draft_to.copy_(want[0][f.draft_index::Q])
    err = max(rel_err(g, w) for g, w in zip(got[:2], want[:2]))
    err = max(err, rel_err(pool, ref_pool))
    written = True
    if fold:
        a, b = folds[1], folds[0]
        err = max(err, rel_err(a.kmin, b.kmin), rel_err(a.kmax, b.kmax), rel_err(a.draft_to.nan_to_num(1e4), b.draft_to))
        written = not a.draft_to.isnan().any().item()
    record(f"qkv epilogue {str(dtype)[6:]} norm {norm} fold {fold} tokens {T}", err, 1e-2 if dtype != torch.float32 else 1e-5, written)


def check_step_tables(L=36, R=16, H=HKV, S=1, K=128, W=4):
    """The step's foreground tables (kernels/step_tables.py), the kernel against the torch form
    on random pipeline states at the qwen3-8b shape: every output equal, the last step's
    write-through kept."""
    from oasiskv.kernels.step_tables import RowState, WriteThrough, step_tables_torch, step_tables_triton
    gen = torch.Generator(device=DEV).manual_seed(5)
    P = S + K + W
    cached = torch.randint(0, 2048 * BS, (R,), generator=gen, device=DEV, dtype=torch.int32)
    cached[:3] = torch.tensor([2 * BS, 37 * BS, 5], dtype=torch.int32)  # window in the sinks; a block's first token
    active = torch.rand(R, generator=gen, device=DEV) < 0.8
    pages = torch.stack([torch.randperm(4 * R * P, generator=gen, device=DEV)[:P] for _ in range(R)]).int()
    resident = torch.randint(S, 2048, (L, R * H, K), generator=gen, device=DEV, dtype=torch.int32)
    resident[torch.rand(resident.shape, generator=gen, device=DEV) < 0.2] = -1
    offsets = torch.randint(0, 10 ** 5, (R,), generator=gen, device=DEV)
    rows = [RowState(*(torch.zeros(R, dtype=d, device=DEV) for d in (torch.long, torch.long, torch.bool, torch.long,
                                                                  torch.long, torch.long, torch.bool))) for _ in range(2)]
    for r in rows:
        r.completes.copy_(active)
        r.block.copy_(cached.long() % 97)
    last = [WriteThrough(torch.zeros(R, dtype=torch.bool, device=DEV), *torch.zeros(2, R, dtype=torch.long, device=DEV))
            for _ in range(2)]
    want = step_tables_torch(cached, active, pages, resident, offsets, H, S, W, BS, 40960, rows[0], last[0])
    got = step_tables_triton(cached, active, pages, resident, offsets, H, S, W, BS, 40960, rows[1], last[1])
    pairs = list(zip(want, got)) + list(zip(*rows)) + list(zip(*last)) + [(last[1].completes, active)]
    bad = sum(not torch.equal(a, b) for a, b in pairs)
    record("step tables (kernel = torch form)", float(bad), 0.5)


def check_graph_replay(dtype=torch.bfloat16, B=4, G=4, Q=2, ctx=2048, replays=1, **kw):
    """Capture once, then change lengths, slot tables and cache contents in place: a replay
    must see the new values (they are read on device, nothing baked in at capture). With
    several replays, each on new values."""
    max_blocks = ctx // BS
    args = decode_inputs(B, HKV, G, Q, max_blocks, dtype, random_lens(B, HKV, ctx))
    out = torch.empty_like(args[0])
    paged_decode_triton(*args, D ** -0.5, out=out, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_triton(*args, D ** -0.5, out=out, **kw)
    err, written = 0.0, True
    for replay in range(replays):
        fresh = decode_inputs(B, HKV, G, Q, max_blocks, dtype, random_lens(B, HKV, ctx), seed=7 + replay)
        for static, new in zip(args, fresh):
            if static is not new:
                static.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        ref = paged_decode_ref(*args, D ** -0.5)
        err, written = max(err, rel_err(out.nan_to_num(1e4), ref)), written and not out.isnan().any().item()
    name = f"graph replay {str(dtype)[6:]} B{B} G{G} Q{Q}" + (f" x{replays} {kw}" if kw else "")
    record(name, err, 1e-2, written)


def time_decode(pool, B, ctx, cfg, num_splits=None, G=HQ // HKV, Q=1):
    """Median microseconds of one graph replay, and the KV bytes it reads."""
    max_blocks = ctx // BS
    args = decode_inputs(B, HKV, G, Q, max_blocks, torch.bfloat16, [ctx] * (B * HKV), pool=pool)
    out = torch.empty_like(args[0])
    run = lambda: paged_decode_triton(*args, D ** -0.5, num_splits=num_splits, out=out, **cfg)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    us = triton.testing.do_bench(graph.replay, warmup=20, rep=60, return_mode="median") * 1e3
    kv_bytes = B * HKV * ctx * 2 * D * 2  # K and V, bf16 (q, tables, partials: < 1%)
    return us, kv_bytes


def time_working_set(B=16, Q=2):
    """The sparse foreground's attention at batch 16: every (request, kv head) attends its
    working set (1 sink + 128 dynamic + 4 window blocks), token and draft rows. Splits 1
    (no merge launch) up to 8, across tiles, stages and warps."""
    pool = torch.randn(B * HKV * 2048 + 64, 2, BS, D, device=DEV, dtype=torch.bfloat16)  # slots scattered as at 32K
    results["working_set"] = []
    print(f"\nworking set: B={B}, Q={Q}, {WORKING_SET_TOKENS} tokens per (request, kv head), bf16")
    for splits in (1, 2, 3, 4, 6, 8):
        for tile, warps, stages in ((8, 4, 3), (4, 4, 3), (8, 4, 4), (8, 8, 3), (16, 8, 3), (4, 4, 4)):
            cfg = dict(tile_blocks=tile, num_warps=warps, num_stages=stages)
            try:
                us, nbytes = time_decode(pool, B, WORKING_SET_TOKENS, cfg, num_splits=splits, Q=Q)
            except Exception as e:  # noqa: BLE001 (a config the compiler refuses, e.g. shared memory)
                print(f"splits {splits} {cfg}: {e!r}"[:200])
                continue
            r = row(B, WORKING_SET_TOKENS, splits, us, nbytes, cfg)
            results["working_set"].append(r)
            print(f"splits {splits} tile {tile} warps {warps} stages {stages}: {r['us']:.1f} us, "
                  f"{r['frac_peak']:.1%} of {PEAK_TBS} TB/s")


def row(B, ctx, splits, us, kv_bytes, extra=None):
    gbs = kv_bytes / us / 1e3
    r = {"B": B, "ctx": ctx, "splits": splits, "us": round(us, 1), "kv_MB": round(kv_bytes / 1e6, 1),
         "GB_s": round(gbs), "frac_peak": round(gbs / (PEAK_TBS * 1e3), 3)}
    r.update(extra or {})
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="checks only, no timing")
    ap.add_argument("--sweep", action="store_true", help="also sweep tile/warps/stages/splits")
    ap.add_argument("--working-set", action="store_true",
                    help="checks, then only the sparse working-set shape timed across splits and tilings")
    opts = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")

    # -- correctness
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for fold in (None, "kv", "fp8"):
            guarded(check_qkv_epilogue, dtype, fold)
    guarded(check_qkv_epilogue, torch.bfloat16, None, norm=False)
    guarded(check_qkv_epilogue, torch.bfloat16, None, R=4099, Q=1)  # a prefill-sized launch: tokens a program
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for G, Q, ctx in [(1, 1, 300), (3, 2, 700), (4, 1, 1000), (8, 4, 257)]:
            guarded(check_decode, 3, 2, G, Q, ctx, dtype)
    guarded(check_decode, 2, 2, 4, 2, 4000, torch.bfloat16, num_splits=1)
    guarded(check_decode, 2, 2, 4, 1, 4000, torch.bfloat16, num_splits=64)
    guarded(check_decode, 2, 2, 4, 2, 1000, torch.float16, tile_blocks=8, num_warps=8)
    guarded(check_decode, 2, 2, 2, 1, 1000, torch.bfloat16, num_splits=5)
    for dtype in (torch.bfloat16, torch.float16):
        guarded(check_decode, 3, 3, 4, 2, 900, dtype, d=64)
    for ctx in (1024, 16384, 32768):
        guarded(check_decode, 16, HKV, 4, 1, ctx, torch.bfloat16, big=True)
    guarded(check_decode, 16, HKV, 4, 2, 16384, torch.float16, big=True)
    guarded(check_decode, 16, HKV, 4, 2, WORKING_SET_TOKENS, torch.bfloat16, big=True, num_splits=1)
    guarded(check_decode, 16, HKV, 4, 2, WORKING_SET_TOKENS, torch.bfloat16, big=True, num_splits=1, num_stages=5)
    guarded(check_graph_replay)
    guarded(check_step_tables)
    n_fail = sum(not c["ok"] for c in results["checks"])

    try:
        if opts.working_set:
            time_working_set()
        elif not opts.quick:
            run_timings(props, opts.sweep)
    finally:
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "kernels.json"), "w") as f:
                json.dump(results, f, indent=1)
    print(f"\n{len(results['checks']) - n_fail}/{len(results['checks'])} checks passed")
    sys.exit(1 if n_fail else 0)


def run_timings(props, sweep):
    """Config sweep (optional), then the table; rows go to `results`."""
    ctxs, batches = (4096, 16384, 32768), (1, 16, 64)
    pool = torch.randn(max(batches) * HKV * max(ctxs) // BS + 64, 2, BS, D, device=DEV,
                       dtype=torch.bfloat16)  # 8.6 GB: every timed slot list is scattered in it
    # The byte ceiling on this card: a large device-to-device copy (read + write).
    src = torch.empty(2 ** 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    results["copy_TB_s"] = round(2 * src.numel() / copy_ms / 1e9, 2)
    print(f"device-to-device copy: {results['copy_TB_s']} TB/s (read + write)")
    del src, dst
    best = {}  # the kernel's defaults unless swept
    if sweep:
        configs = [dict(tile_blocks=t, num_warps=w, num_stages=s)
                   for t, w, s in [(4, 4, 3), (2, 4, 3), (4, 2, 3), (4, 4, 1), (4, 8, 3),
                                   (8, 4, 3), (8, 8, 3), (16, 8, 3)]]
        for cfg in configs:
            try:
                us, nbytes = time_decode(pool, 16, 32768, cfg)
            except Exception as e:  # noqa: BLE001 (e.g. out of shared memory)
                print("sweep", cfg, "failed:", repr(e)[:300])
                continue
            results["sweep"].append(row(16, 32768, "auto", us, nbytes, cfg))
            print("sweep", results["sweep"][-1])
        fastest = min(results["sweep"], key=lambda r: r["us"])
        best = {k: fastest[k] for k in ("tile_blocks", "num_warps", "num_stages")}
        for B in (1, 16, 64):
            for splits in (1, 2, 4, 8, 16, 32, 64):
                us, nbytes = time_decode(pool, B, 32768, best, num_splits=splits)
                results["sweep"].append(row(B, 32768, splits, us, nbytes, best))
                print("sweep", results["sweep"][-1])
    print(f"\npaged_decode_triton, Hq={HQ} Hkv={HKV} D={D} bf16, Q=1, config {best or 'default'}")
    print(f"{'B':>4} {'ctx':>6} {'splits':>6} {'time us':>9} {'KV MB':>9} {'GB/s':>7} {'of 4.25TB/s':>11}")
    for B in batches:
        for ctx in ctxs:
            us, nbytes = time_decode(pool, B, ctx, best)
            splits = choose_num_splits(B * HKV, ctx // BS, props.multi_processor_count,
                                       **({"tile_blocks": best["tile_blocks"]} if best else {}))
            r = row(B, ctx, splits, us, nbytes)
            results["table"].append(r)
            print(f"{B:>4} {ctx:>6} {splits:>6} {r['us']:>9.1f} {r['kv_MB']:>9.1f} {r['GB_s']:>7} "
                  f"{r['frac_peak']:>11.1%}")
    us, nbytes = time_decode(pool, 16, 32768, best, Q=2)
    r = row(16, 32768, "auto", us, nbytes, {"Q": 2})
    results["table"].append(r)
    print(f"Q=2 (token + draft), B=16, ctx=32768: {r['us']} us, {r['GB_s']} GB/s, {r['frac_peak']:.1%}")


if __name__ == "__main__":
    main()
