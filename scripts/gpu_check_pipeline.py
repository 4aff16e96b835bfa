"""GPU checks of the lookahead pipeline, in one process (run on the GPU machine):

1. the in-place capped eviction kernel against its torch form at engine sizes;
2. the bounded-grid item copy, host (pinned, through UVA) -> GPU and back, against indexing;
3. a captured sparse decode step (foreground + three pipeline streams in one CUDA graph)
   against the same steps run eagerly with the stages in line: same tokens, same resident
   blocks, same counters, same host pool;
4. timings: eviction per layer, and the copy's GB/s alone and beside GEMMs, per grid size.

    PYTHONPATH=. python3 scripts/gpu_check_pipeline.py [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path[:0] = ["tests", "tests/kernels"]  # the test module and the helpers it imports
from test_pipeline_kernels import random_eviction_inputs  # noqa: E402

from oasiskv.kernels.capped_eviction import capped_eviction_triton, eviction_marks  # noqa: E402
from oasiskv.kernels.copy_items import copy_items, device_view  # noqa: E402
from oasiskv.sparse.capped_eviction import capped_eviction_  # noqa: E402
from oasiskv.sparse.host_pool import HostKVPool  # noqa: E402

dev = torch.device("cuda")


def check_eviction(results: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    for reqs, heads, K, P, blocks, cap in ((16, 8, 128, 128, 2048, 7), (16, 8, 128, 128, 600, 128),
                                           (4, 8, 32, 32, 256, 2)):
        bad = 0
        res, last, pred, win = random_eviction_inputs(reqs, heads, K, P, blocks, 1, gen)
        g_res, g_last = res.to(dev), last.to(dev)
        for step in range(1, 6):
            if step > 1:
                _, _, pred, win = random_eviction_inputs(reqs, heads, K, P, blocks, 1, gen)
            R = reqs * heads
            outs = []
            for fn, d, (r, l) in ((capped_eviction_, "cpu", (res, last)), (capped_eviction_triton, "cuda", (g_res, g_last))):
                ab = torch.full((R, cap), -1, dtype=torch.int32, device=d)
                asl = torch.full_like(ab, -1)
                st = torch.zeros(R, 4, dtype=torch.long, device=d)
                fn(r, l, pred.to(d), 1, win.to(d), heads, cap, torch.tensor(step, dtype=torch.int32, device=d),
                   ab, asl, st)
                outs.append([t.cpu().long() for t in (r, l, ab, asl, st)])
            bad += sum(not torch.equal(a, b) for a, b in zip(*outs))
        results[f"eviction R={reqs * heads} K={K} C={cap} mismatches"] = bad
        # time at this size (graph replay of one launch)
        R = reqs * heads
        ab = torch.full((R, cap), -1, dtype=torch.int32, device=dev)
        asl, st = torch.full_like(ab, -1), torch.zeros(R, 4, dtype=torch.long, device=dev)
        step_t = torch.tensor(9, dtype=torch.int32, device=dev)
        gp, gw = pred.to(dev), win.to(dev)
        marks = eviction_marks(R, blocks, dev)
        run = lambda: capped_eviction_triton(g_res, g_last, gp, 1, gw, heads, cap, step_t, ab, asl, st,  # noqa: E731
                                              marks=marks)
        results[f"eviction R={R} K={K} C={cap} us"] = 1e3 * time_graph(run)
        results[f"eviction R={R} K={K} C={cap} marks left"] = int((marks != -1).sum())


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn run once (compiles its kernels), then captured, replayed once and synced."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def time_graph(fn, iters: int = 50) -> float:
    g = capture(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters  # ms


def check_copy(results: dict) -> None:
    pool = HostKVPool(0, 16, 128, torch.bfloat16, pin=True, num_items=64 * 1024)  # 512 MiB
    pool.items.view(-1).copy_(torch.randn(pool.items.numel(), dtype=torch.bfloat16))
    host = device_view(pool.items, dev)
    gpu = torch.randn(40000, 2, 16, 128, dtype=torch.bfloat16, device=dev)
    src = torch.randperm(pool.num_items, device=dev)[:32768]
    dst = torch.randperm(gpu.shape[0], device=dev)[:32768]
    src[::7] = -1  # skipped entries
    want = gpu.clone()
    keep = src >= 0
    want[dst[keep]] = pool.items[src[keep].cpu()].to(dev)
    copy_items(host, gpu, src, dst)
    results["copy host->gpu exact"] = bool(torch.equal(gpu, want))
    back = torch.arange(100, device=dev)
    copy_items(gpu, host, back, back + 5000)  # GPU -> host through the same view
    torch.cuda.synchronize()
    results["copy gpu->host exact"] = bool(torch.equal(pool.items[5000:5100], gpu[:100].cpu()))

    n = 32768
    src, dst = torch.randperm(pool.num_items, device=dev)[:n], torch.randperm(gpu.shape[0], device=dev)[:n]
    nbytes = n * pool.item_bytes
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    gemms = lambda: [a @ a for _ in range(6)]  # noqa: E731
    results["6 GEMMs alone ms"] = time_eager(gemms)
    side = torch.cuda.Stream()
    for programs in (8, 16, 32, 64, 132):
        ms = time_eager(lambda: copy_items(host, gpu, src, dst, programs))
        results[f"copy G={programs} alone GB/s"] = nbytes / ms / 1e6

        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                copy_items(host, gpu, src, dst, programs)
            gemms()
            torch.cuda.current_stream().wait_stream(side)
        results[f"copy G={programs} + 6 GEMMs ms"] = time_eager(both)


def time_eager(fn, iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def check_graph_step(results: dict) -> None:
    """Captured step vs eager in-line step from the same synthetic state."""
    import dataclasses

    from oasiskv.config import EngineConfig
    from oasiskv.engine.model_runner import ModelRunner
    from oasiskv.sparse.decode_step import SparseDecodeStep
    from oasiskv.sparse.pipeline import LookaheadPipeline
    from oasiskv.sparse.tuning import PipelineTuning

    cfg = EngineConfig(model="llama-3.1-8b", load_format="dummy", dtype="float32", max_model_len=4096,
                       max_num_seqs=4, kv_cache_gb=8, enforce_eager=True)
    r = ModelRunner(cfg)
    mc = r.model_config
    sc = dataclasses.replace(cfg.sparse, enabled=True, top_k_blocks=32, fetch_ratio=0.1)
    B, ctx, bs = 4, 3000, r.block_size
    nb = (ctx + 64) // bs + 1
    host = HostKVPool(0, bs, mc.head_dim, r.dtype, pin=True, num_items=B * mc.num_layers * nb * mc.num_kv_heads)
    host.items.normal_()
    r.kv.normal_()
    runs = {}
    for mode in ("eager", "graph"):
        kv0 = r.kv.clone() if mode == "eager" else None
        if mode == "graph":
            r.kv.copy_(runs["kv0"])
            host.items.copy_(runs["host0"])
        # The same GEMM kernels in both (no carve-out: the eager in-line step runs without it): a
        # different cuBLAS kernel rounds differently, and near-equal block scores then swap.
        tuning = PipelineTuning(background=mode == "graph", gemm_sm_carveout=None)
        p = LookaheadPipeline(sc, mc, r.kv, host, max_rows=B, max_blocks=nb, block_size=bs, tuning=tuning)
        first = p.arena.offset(B * sc.working_set_blocks)
        torch.manual_seed(1)
        for i in range(B):
            ext = host.allocate(f"{mode}{i}", mc.num_layers, nb, mc.num_kv_heads)
            p.bind(i, list(range(i * sc.working_set_blocks, (i + 1) * sc.working_set_blocks)), ext, first + i * nb)
        pick = torch.rand(mc.num_layers, B * mc.num_kv_heads, ctx // bs - 5, device=dev).argsort(-1)
        p.resident.copy_((pick[..., :sc.top_k_blocks] + 1).int())
        p.last.zero_()
        held = slice(first, first + B * nb)  # the summaries, in the pages after the working sets'
        lo = torch.randn(p.kmin[:, held].shape, device=dev)
        p.kmin[:, held] = lo.to(p.kmin.dtype)
        p.kmax[:, held] = (lo + torch.randn_like(lo).abs()).to(p.kmax.dtype)
        p.cached.fill_(ctx - 1)
        p.active.fill_(True)
        if mode == "eager":
            runs["kv0"], runs["host0"] = kv0, host.items.clone()
        step = SparseDecodeStep(r.model, r.kv_caches, p, mc.max_position_embeddings, use_graph=mode == "graph")
        ids = torch.arange(B * 2, device=dev) * 97 % mc.vocab_size
        toks = []
        for _ in range(20):
            logits = r.model.compute_logits(step.run(ids))
            t, d = logits[0::2].argmax(-1), logits[1::2].argmax(-1)
            toks.append(t.tolist())
            ids = torch.stack([t, d], 1).view(-1)
        p.flush_deferred()  # the last step's deferred transfers and write-through land
        torch.cuda.synchronize()
        runs[mode] = (toks, p.resident.clone(), p.stats.clone(), p.fetched_bytes, host.items.clone())
        for i in range(B):
            host.free(f"{mode}{i}")
        del step, p
    e, g = runs["eager"], runs["graph"]
    results["graph step tokens equal"] = e[0] == g[0]
    results["graph step resident equal"] = bool(torch.equal(e[1], g[1]))
    results["graph step counters equal"] = bool(torch.equal(e[2], g[2]) and e[3] == g[3])
    results["graph step host pool equal"] = bool(torch.equal(e[4], g[4]))
    results["graph step admitted"] = int(e[2][:, 2].sum())


def report(results: dict, json_path: str | None) -> None:
    """Every result, one a line, then all of them to `json_path` (when given)."""
    for k, v in results.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--checks", default="eviction,copy,graph_step", help="which of them, comma-separated")
    args = ap.parse_args()
    results: dict = {}
    for check in (globals()["check_" + name] for name in args.checks.split(",")):
        try:
            check(results)
        except Exception as exc:  # report and go on: one run of the device must say everything
            import traceback
            traceback.print_exc()
            results[check.__name__ + " error"] = repr(exc)
    report(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
