"""`bench decode --transfer-backend dma`: the host-side transfer against the pipeline's own."""
import torch

from oasiskv.bench.dma_transfer import DmaTransfer
from oasiskv.models.config import PRESETS
from oasiskv.sparse.config import SparseConfig
from oasiskv.sparse.host_pool import HostKVPool
from oasiskv.sparse.pipeline import LookaheadPipeline


def test_dma_backend_moves_what_the_kernel_moves():
    """Transfer backends: the CPU gather + one DMA copy ("dma", between steps) leaves the GPU pool
    as the in-step copy ("uva") does, for the same selections."""
    mc = PRESETS["smollm2-135m"]
    L, H, D, bs, nb, R = mc.num_layers, mc.num_kv_heads, mc.head_dim, 16, 40, 3
    cfg = SparseConfig(enabled=True, top_k_blocks=8, window_blocks=2, sink_blocks=1, fetch_ratio=0.5,
                       sparse_threshold=256, host_kv_gb=0.1)
    gen = torch.Generator().manual_seed(3)
    host = HostKVPool(0, bs, D, torch.float32, pin=False, num_items=R * L * nb * H)
    host.items.copy_(torch.randn(host.items.shape, generator=gen))
    kv0 = torch.randn(L, 64 * H, 2, bs, D, generator=gen)
    predicted = torch.stack([torch.randperm(30, generator=gen)[:8] + 1 for _ in range(L * R * H)])
    pools = {}
    for backend in ("uva", "dma"):
        kv = kv0.clone()
        p = LookaheadPipeline(cfg, mc, kv, host, max_rows=R, max_blocks=nb, block_size=bs)
        for r in range(R):
            ext = host.allocate(f"{backend}{r}", L, nb, H)
            p.bind(r, list(range(r * cfg.working_set_blocks, (r + 1) * cfg.working_set_blocks)), ext,
                   p.arena.offset(R * cfg.working_set_blocks) + r * nb)
        p.resident[:] = torch.arange(1, 9, dtype=torch.int32)
        p.last.zero_()
        p.cached[:R] = 35 * bs
        p.active[:R] = True
        p.step_tables(mc.max_position_embeddings)
        p.predicted[:] = predicted.view(L, R * H, 8).int()
        for layer in range(L):
            p.select(layer)
            if backend == "uva":
                p.transfer(layer)
        if backend == "dma":
            DmaTransfer(p)()
        pools[backend] = (kv, p.resident.clone(), int(p.stats[:, 2].sum()))
        for r in range(R):
            host.free(f"{backend}{r}")
    assert pools["uva"][2] > 0
    assert torch.equal(pools["uva"][1], pools["dma"][1])
    assert torch.equal(pools["uva"][0], pools["dma"][0])
    assert not torch.equal(pools["uva"][0], kv0)
