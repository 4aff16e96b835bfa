"""Block min/max key summaries (oasiskv/sparse/summaries.py, their rounding and decode's fold in
oasiskv/kernels/summary_fold.py): the one-shot build against a per-block loop, and the incremental
decode update against rebuilding from all tokens."""
from __future__ import annotations

import pytest
import torch

from oasiskv.kernels.summary_fold import FP8, to_summary, update_block_minmax
from oasiskv.sparse.summaries import block_minmax, summary_dtype, write_block_minmax


@pytest.mark.parametrize("n,bs", [(1, 16), (16, 16), (37, 16), (64, 16), (13, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_minmax_matches_loop(n, bs, dtype):
    keys = torch.randn(n, 3, 64, generator=torch.Generator().manual_seed(n)).to(dtype)
    kmin, kmax = block_minmax(keys, bs)
    nb = -(-n // bs)
    assert kmin.shape == kmax.shape == (nb, 3, 64) and kmin.dtype == dtype
    for b in range(nb):
        chunk = keys[b * bs:(b + 1) * bs]  # the last one partial: only its valid tokens
        assert torch.equal(kmin[b], chunk.amin(0)) and torch.equal(kmax[b], chunk.amax(0))


def test_block_minmax_empty():
    kmin, kmax = block_minmax(torch.randn(0, 2, 8), 16)
    assert kmin.shape == kmax.shape == (0, 2, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_incremental_update_matches_rebuild(dtype):
    """Three requests at different offsets of one global tensor decode token by token (one row
    each per step, plus a padding row -1); their summaries always equal a rebuild."""
    gen = torch.Generator().manual_seed(0)
    bs, H, D, steps = 4, 2, 16, 11
    prompt = [5, 8, 0]  # partial, full, empty
    cap = [-(-(p + steps) // bs) for p in prompt]
    offsets = [0, cap[0], cap[0] + cap[1]]
    total = sum(cap)
    # Garbage in the unused blocks (a freed block's stale summary) must be overwritten.
    kmin = torch.randn(total, H, D, generator=gen).to(dtype)
    kmax = kmin + 5
    tokens = [torch.randn(p, H, D, generator=gen).to(dtype) for p in prompt]
    for i, t in enumerate(tokens):
        lo, hi = block_minmax(t, bs)
        kmin[offsets[i]:offsets[i] + len(lo)] = lo
        kmax[offsets[i]:offsets[i] + len(hi)] = hi
    for _ in range(steps):
        new = torch.randn(3, H, D, generator=gen).to(dtype)
        pos = torch.tensor([len(t) for t in tokens])
        block_ids = torch.tensor(offsets) + pos // bs
        first = pos % bs == 0
        pad = torch.tensor([-1])
        update_block_minmax(kmin, kmax, torch.cat([block_ids, pad]),
                            torch.cat([new, torch.randn(1, H, D).to(dtype)]),
                            torch.cat([first, torch.tensor([True])]))
        tokens = [torch.cat([t, new[i:i + 1]]) for i, t in enumerate(tokens)]
        for i, t in enumerate(tokens):
            lo, hi = block_minmax(t, bs)
            assert torch.equal(kmin[offsets[i]:offsets[i] + len(lo)], lo)
            assert torch.equal(kmax[offsets[i]:offsets[i] + len(hi)], hi)


def test_update_with_several_tokens_of_one_block():
    """A chunk of tokens into one block in one call: a fresh block (one row is first) is the
    min/max of the chunk alone; a continued block also folds in its old summary."""
    gen = torch.Generator().manual_seed(1)
    kmin = torch.randn(3, 1, 8, generator=gen)
    kmax = kmin + 1
    old_min, old_max = kmin[2].clone(), kmax[2].clone()
    keys = torch.randn(5, 1, 8, generator=gen)
    ids = torch.tensor([1, 1, 1, 2, 2])
    first = torch.tensor([False, True, False, False, False])
    update_block_minmax(kmin, kmax, ids, keys, first)
    assert torch.equal(kmin[1], keys[:3].amin(0)) and torch.equal(kmax[1], keys[:3].amax(0))
    assert torch.equal(kmin[2], torch.minimum(old_min, keys[3:].amin(0)))
    assert torch.equal(kmax[2], torch.maximum(old_max, keys[3:].amax(0)))


def test_fp8_summaries_are_the_rounded_exact_ones():
    """fp8 storage: built at once or token by token (one call per token, a padding row beside),
    the summaries equal the exact float32 min rounded down and max rounded up once (the box
    still holds every key), keys past ±448 saturating."""
    gen = torch.Generator().manual_seed(2)
    bs, H, D, n = 4, 2, 16, 23
    keys = torch.randn(n, H, D, generator=gen) * 200  # a few past e4m3's ±448
    lo, hi = block_minmax(keys, bs)
    want_min, want_max = to_summary(lo, FP8, -1), to_summary(hi, FP8, +1)
    assert want_max.float().max() == 448 and not want_min.float().isnan().any()
    low, high = lo.abs() < 448, hi.abs() < 448  # past ±448 they saturate
    assert (want_min.float()[low] <= lo[low]).all() and (want_max.float()[high] >= hi[high]).all()
    assert (want_max.float() > to_summary(hi, FP8).float()).any()  # not the nearest rounding
    built = torch.empty(6, H, D, dtype=FP8), torch.empty(6, H, D, dtype=FP8)
    write_block_minmax(*built, keys, bs)
    kmin = torch.full((6, H, D), 3.0).to(FP8)  # stale values, reset by each block's first token
    kmax = kmin.clone()
    for i in range(n):
        update_block_minmax(kmin, kmax, torch.tensor([i // bs, -1]), torch.cat([keys[i:i + 1], keys[:1]]),
                            torch.tensor([i % bs == 0, True]))
    for got_min, got_max in (built, (kmin, kmax)):
        assert got_min.dtype == FP8
        assert torch.equal(got_min.float(), want_min.float()) and torch.equal(got_max.float(), want_max.float())


def test_summary_dtype_auto_is_fp8_on_cuda_only():
    """`auto` stores fp8 where the KV cache is on CUDA and the KV dtype elsewhere; `kv` and `fp8`
    are what they say on any device; anything else is refused."""
    assert summary_dtype("auto", torch.bfloat16, torch.device("cuda", 0)) == FP8
    assert summary_dtype("auto", torch.bfloat16, "cuda") == FP8
    assert summary_dtype("auto", torch.float32, "cpu") == torch.float32
    assert summary_dtype("auto", torch.float32) == torch.float32
    assert summary_dtype("kv", torch.bfloat16, "cuda") == torch.bfloat16
    assert summary_dtype("fp8", torch.float32, "cpu") == FP8
    with pytest.raises(ValueError, match="unknown summary dtype"):
        summary_dtype("bf16", torch.bfloat16, "cuda")
