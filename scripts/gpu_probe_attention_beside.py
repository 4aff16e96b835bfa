"""What in the transfer slows the working-set attention? (prepared in the seventh session, for the
next device call.) In the batch 16, 16K step the attention with 5 stages takes 39 µs a layer
with the pipeline's stages off and 55 µs with them on; with 3 stages 48 and 51 µs. What runs
beside it then is the transfer: 8 persistent fetch programs reading pinned host memory through
UVA (docs/benchmarks.md, seventh session, item 3). Splitting the attention into more programs
did not help, so the slowdown is not confined to the SMs that host a fetch program.

Here the attention (batch 16, 1 + 128 + 4 blocks per request and kv head, one split; 36
launches in a graph, as in a step) is timed alone and beside one step's transfers (36 fetch
launches, 264 MB, replayed on a side stream for the whole timing window), five ways:

    uva 8        the step's transfer: 8 load-unit programs reading host memory (the default)
    uva 8 tma    8 programs through TMA (6 stages)
    hbm 8        the same kernel and grid reading the same plan from a copy of the pool in HBM
    uva 8 w4     8 programs of 4 warps instead of 8
    uva 4        4 programs

Prediction. If the host reads themselves interfere (PCIe requests held long in each SM's
memory pipeline, or the host path shared by all SMs), "hbm 8" leaves the attention as fast as
alone, and the UVA variants slow it, the 5-stage kernel most. If it is the 8 resident programs'
issue pressure, "hbm 8" slows it as much, and "uva 8 w4" and "uva 4" less.

Measured 2026-12-02 (eighth session): beside every variant the attention slows by only ~5 µs
(5 stages: 39.8 alone, 44.3 beside uva 8, 45.3 beside hbm 8), yet in the step, beside the fetch
alone, it takes 57 µs. What the step has and this probe had not is size: the step's working
set spans 36 layers (~5 GB of HBM) and its host extents 64 MB per request and layer (the probe:
4 attention buffers, 16 MB extents). --attention-buffers 36 --blocks 1024 gives the probe the
step's footprint: if the attention then slows to ~57 µs beside the fetch, address translation
(TLB reach over the two footprints) is what the two share.
Measured: 50.0 µs beside the UVA fetch against 43.9 beside the HBM one, and with the host pool
on huge pages 44.0 against 44.3; "uva 8 into attention" (the fetch writing the attention's
working sets, as in the step) changed nothing (45.3 against 45.1).

Prepared in the ninth session (not run yet): "uva 4 w32", 4 fetch programs of 32 warps with 16
items in flight. Each takes its SM's whole register file, so the 128 attention programs (one
split, one an SM at 5 stages) have the other 128 SMs to themselves; the default fetch program
(256 threads of 48 registers) leaves room for an attention program beside it. Prediction: if
sharing an SM with a fetch program is what slows the attention, it stays near its time alone
beside "uva 4 w32" (that form moved ~45 GB/s in the later session of 2026-12-01), where beside
"uva 8" it slows.

    PYTHONPATH=. python3 scripts/gpu_probe_attention_beside.py [--attention-buffers N] [--blocks NB]
        [--transfers "uva 8,hbm 8"] [--json OUT]
"""
from __future__ import annotations

import argparse

import torch

from gpu_check_pipeline import capture, report, time_eager  # scripts/ is on the path when run as a script
from gpu_check_transfer_tma import C, H, L, P, R, S
from oasiskv.kernels.copy_items import device_view, fetch_admitted
from oasiskv.kernels.paged_decode import paged_decode_triton
from oasiskv.sparse.host_pool import HostKVPool

dev = torch.device("cuda")
HQ, D, BS, WS_BLOCKS = 32, 128, 16, 1 + 128 + 4
TRANSFERS = {  # name: (source, programs, warps, items a load, TMA stages, into the attention's working sets)
    "uva 8": ("uva", 8, 8, 4, 0, False), "uva 8 tma": ("uva", 8, 8, 4, 6, False), "hbm 8": ("hbm", 8, 8, 4, 0, False),
    "uva 8 w4": ("uva", 8, 4, 4, 0, False), "uva 4": ("uva", 4, 8, 4, 0, False),
    "uva 8 into attention": ("uva", 8, 8, 4, 0, True),  # as in the step: the fetch writes the pool the attention reads
    # 1,024 threads of 64 registers: the whole register file of its SM, so no attention program
    # can share one (scripts/inspect_decode_kernel.py --fetch)
    "uva 4 w32": ("uva", 4, 32, 16, 0, False),
}


def plan(gen, blocks_per_request: int):
    """A fetch plan per layer: block ids (some -1) and distinct working-set slots per row."""
    blocks = torch.randint(0, blocks_per_request, (L, R * H, C), generator=gen, dtype=torch.int32)
    blocks[:, ::5, -1] = -1
    slots = torch.stack([torch.randperm(P - S - 4, generator=gen)[:C] for _ in range(L * R * H)])
    return blocks.to(dev), slots.view(L, R * H, C).int().to(dev)


def working_sets(buffers: int) -> list[tuple]:
    """`buffers` working sets of a batch 16 step's attention: (q, k_new, v_new, pool, slot
    tables, lengths, out) each."""
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = []
    for _ in range(buffers):
        items = max(R * H * WS_BLOCKS + 64, R * P * H)  # room for the fetch's slots too
        pool = torch.randn(items, 2, BS, D, device=dev, generator=gen).to(torch.bfloat16)
        slots = torch.randperm(pool.shape[0] - 64, device=dev, generator=gen)[:R * H * WS_BLOCKS]
        q = torch.randn(R, 2, HQ, D, device=dev, generator=gen).to(torch.bfloat16)
        kn = torch.randn(R, 2, H, D, device=dev, generator=gen).to(torch.bfloat16)
        layers.append((q, kn, torch.randn_like(kn), pool, slots.view(R, H, WS_BLOCKS).int(),
                       torch.full((R, H), WS_BLOCKS * BS - BS // 2, device=dev, dtype=torch.int32),
                       torch.empty_like(q)))
    return layers


def attend(layer: tuple, stages: int) -> torch.Tensor:
    q, kn, vn, pool, slots, lens, out = layer
    return paged_decode_triton(q, kn, vn, pool, slots, lens, D ** -0.5, num_splits=1, num_stages=stages, out=out)


def attention_graphs(buffers: int) -> tuple[dict, list]:
    """The working-set attention of one step (36 layers cycling over `buffers` working sets; 4
    already miss L2), 3 and 5 stages; and the buffers the graphs read and write, which must
    outlive them."""
    layers = working_sets(buffers)

    def step(stages):
        for i in range(L):
            attend(layers[i % buffers], stages)
    return {stages: capture(lambda: step(stages)) for stages in (3, 5)}, layers


def transfer_graphs(res: dict, names: list[str], blocks_per_request: int, working_sets: list) -> tuple[dict, tuple]:
    """One step's 36 fetches per variant named (of TRANSFERS), each timed alone (GB/s); and the
    buffers the graphs read and write, which must outlive them. working_sets: the attention's
    pools, which "into attention" variants write (layer l into pool l % len)."""
    gen = torch.Generator().manual_seed(0)
    NB = blocks_per_request
    pool = HostKVPool(0, 16, 128, torch.bfloat16, pin=True, num_items=R * L * NB * H)  # 9 GiB at 256 blocks
    sources = {"uva": device_view(pool.items, dev)}
    if any(TRANSFERS[name][0] == "hbm" for name in names):  # a copy of the pool in HBM
        sources["hbm"] = torch.empty(pool.items.shape, dtype=torch.bfloat16, device=dev)
    pages = torch.arange(R * P, dtype=torch.int32, device=dev).view(R, P)
    start = torch.arange(R, device=dev) * (L * NB * H)
    nblocks = torch.full((R,), NB, device=dev)
    blocks, slots = plan(gen, NB)
    kv = torch.zeros(R * P * H, 2, 16, 128, dtype=torch.bfloat16, device=dev)
    moved = int((blocks >= 0).sum()) * pool.item_bytes
    graphs = {}
    for name in names:
        source, programs, warps, items, tma, into_attention = TRANSFERS[name]
        def step():
            for layer in range(L):
                dst = working_sets[layer % len(working_sets)] if into_attention else kv
                fetch_admitted(sources[source], dst, layer, blocks[layer], slots[layer], pages, start, nblocks, H, S,
                               num_programs=programs, items_per_load=items, num_warps=warps, tma_stages=tma)
        try:
            graphs[name] = g = capture(step)
            res[f"{name}: alone GB/s"] = moved / time_eager(g.replay) / 1e6
        except Exception as exc:  # noqa: BLE001 (report and go on)
            res[f"{name}: error"] = repr(exc)[:200]
        print(list(res.items())[-1], flush=True)
    return graphs, (pool, sources, kv)


def time_beside(graph: torch.cuda.CUDAGraph, transfer: torch.cuda.CUDAGraph, reps: int = 5,
                transfer_reps: int = 4) -> float:
    """ms a replay of `graph` while `transfer` replays on a side stream (queued first, enough
    of them to outlast the timed replays)."""
    side = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(transfer_reps):
            transfer.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention-buffers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=256, help="context blocks per request (host extent size)")
    ap.add_argument("--transfers", default=",".join(TRANSFERS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res: dict = {"attention buffers": args.attention_buffers, "blocks": args.blocks}
    attention, _layers = attention_graphs(args.attention_buffers)
    transfers, _buffers = transfer_graphs(res, args.transfers.split(","), args.blocks, [x[3] for x in _layers])
    for stages, g in attention.items():
        res[f"attention {stages} stages: alone us a layer"] = 1e3 * time_eager(g.replay) / L
        for name in args.transfers.split(","):
            if name not in transfers:
                continue
            res[f"attention {stages} stages: beside {name} us a layer"] = 1e3 * time_beside(g, transfers[name]) / L
            print(list(res.items())[-1], flush=True)
    report(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
