"""The transfer stage through TMA against the load-unit kernel, on one H200 (first run
2026-12-01: exact; 37.9 GB/s at 4 programs, but about 38 at most, against 45.8 for 8
load-unit programs; docs/results/check_transfer_tma_h200.json). Three questions, in one process:

1. Does a TMA descriptor over pinned host memory (its UVA address) load the right items? The
   TMA fetch, the load-unit fetch and torch indexing must agree exactly on a plan of the
   benchmark's shape (16 requests x 8 kv heads x 7 admissions, some entries skipped).
2. How fast is it alone? A CUDA graph of 36 launches (one step's transfers at batch 16, fetch
   ratio 0.05: 264 MB): GB/s for the load-unit kernel at 4 and 8 programs and for TMA at 1-8
   programs and 4-8 stages. The load-unit kernel is bound per SM (~6 GB/s a program); if TMA is
   not, 2-4 programs should reach what 8 reach now.
3. Beside weight-streaming GEMMs (the decode step's gate_up shape at 32 rows, on the main
   stream): the GEMMs' slowdown and the transfer's GB/s, per variant.

    PYTHONPATH=. python3 scripts/gpu_check_transfer_tma.py [--json OUT]
"""
from __future__ import annotations

import argparse

import torch

from gpu_check_pipeline import report, time_eager  # scripts/ is on the path when run as a script
from oasiskv.kernels.copy_items import device_view, fetch_admitted
from oasiskv.sparse.host_pool import HostKVPool

dev = torch.device("cuda")
L, R, H, C, P, S, NB = 36, 16, 8, 7, 140, 1, 256  # layers, requests, kv heads, cap, pages, sinks, blocks


def plan(gen):
    """A fetch plan per layer: block ids (some -1) and distinct working-set slots per row."""
    blocks = torch.randint(0, NB, (L, R * H, C), generator=gen, dtype=torch.int32)
    blocks[:, ::5, -1] = -1
    slots = torch.stack([torch.randperm(P - S - 4, generator=gen)[:C] for _ in range(L * R * H)])
    return blocks.to(dev), slots.view(L, R * H, C).int().to(dev)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    pool = HostKVPool(0, 16, 128, torch.bfloat16, pin=True, num_items=R * L * NB * H)  # 9 GiB
    host = device_view(pool.items, dev)
    pages = torch.arange(R * P, dtype=torch.int32, device=dev).view(R, P)
    start = torch.arange(R, device=dev) * (L * NB * H)
    nblocks = torch.full((R,), NB, device=dev)
    blocks, slots = plan(gen)
    kv = torch.zeros(R * P * H, 2, 16, 128, dtype=torch.bfloat16, device=dev)
    res: dict = {}

    # 1. exactness, one layer, on random item contents
    layer = 3
    row, head = torch.arange(R)[:, None, None], torch.arange(H)[None, :, None]
    blk, slot = blocks[layer].view(R, H, C).long().cpu(), slots[layer].view(R, H, C).long().cpu()
    used = blk >= 0
    items = (start.cpu()[:, None, None] + (layer * NB + blk) * H + head)[used]
    dst = (pages.long().cpu()[row, S + slot] * H + head)[used]
    pool.items[items] = torch.randn(len(items), 2, 16, 128).to(torch.bfloat16)
    for name, kw in (("loads", {}), ("tma", {"tma_stages": 6})):
        out = torch.randn_like(kv)
        want = out.clone()
        want[dst.to(dev)] = pool.items[items].to(dev)
        try:
            fetch_admitted(host, out, layer, blocks[layer], slots[layer], pages, start, nblocks, H, S, **kw)
            torch.cuda.synchronize()
            res[f"{name} exact"] = bool(torch.equal(out, want))
        except Exception as exc:  # noqa: BLE001 (e.g. a descriptor the driver refuses over host memory)
            res[f"{name} exact"], res[f"{name} error"] = False, repr(exc)[:300]
    print(res, flush=True)

    # 2. alone: one step's 36 transfers in a graph
    moved = int((blocks >= 0).sum()) * pool.item_bytes
    variants = [("loads", p, 0) for p in (4, 8)]
    if res["tma exact"]:
        variants += [("tma", p, st) for p in (1, 2, 4, 8) for st in (4, 6, 8)]

    def step_of(programs, stages):
        def step():
            for layer in range(L):
                fetch_admitted(host, kv, layer, blocks[layer], slots[layer], pages, start, nblocks, H, S,
                               num_programs=programs, tma_stages=stages)
        return step

    graphs = {}
    for name, programs, stages in variants:
        try:
            step_of(programs, stages)()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step_of(programs, stages)()
            graphs[(name, programs, stages)] = g
            ms = time_eager(g.replay)
            res[f"{name} P={programs} stages={stages} alone GB/s"] = moved / ms / 1e6
        except Exception as exc:  # noqa: BLE001 (report and go on)
            res[f"{name} P={programs} stages={stages} error"] = repr(exc)[:200]
        print(list(res.items())[-1], flush=True)

    # 3. beside weight-streaming GEMMs on the main stream
    x = torch.randn(32, 4096, dtype=torch.bfloat16, device=dev)
    ws = [torch.randn(24576, 4096, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(4)]
    gemms = lambda: [torch.nn.functional.linear(x, ws[i % 4]) for i in range(140)]  # noqa: E731 (~7 ms)
    res["GEMMs alone ms"] = alone = time_eager(gemms)
    side = torch.cuda.Stream()
    for key, g in graphs.items():
        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                g.replay()
            gemms()
            torch.cuda.current_stream().wait_stream(side)
        ms = time_eager(both)
        res[f"{key[0]} P={key[1]} stages={key[2]} + GEMMs ms"] = ms
        res[f"{key[0]} P={key[1]} stages={key[2]} GEMM slowdown"] = ms / alone
        print(key, f"{ms:.2f} ms against {alone:.2f} alone", flush=True)
    report(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
