"""The fused qkv epilogue (oasiskv/kernels/qkv_epilogue.py) against its reference, the
separate norm / RoPE / store / fold functions, under Triton's CPU interpreter (a subprocess,
as in test_kernels.py), on random inputs: with and without q/k norm, tokens not stored (-1
slots: drafts), the summary fold in the KV dtype and in fp8 with rows skipped and blocks
starting, the draft copy from either query row. bf16 is checked on the GPU machine."""
from __future__ import annotations

import json
import os

import pytest
import torch
from triton_interpreter import run_under_interpreter

from oasiskv.kernels import qkv_epilogue as epilogue
from oasiskv.kernels.qkv_epilogue import SummaryFold, qkv_epilogue_ref, qkv_epilogue_triton
from oasiskv.kernels.summary_fold import update_block_minmax
from oasiskv.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.slow

CASES = {  # id: (rows R, Q, Hq, Hkv, D, dtype, q/k norm, fold: None | "kv" | "fp8", draft index)
    "plain_fp32_q1": (5, 1, 4, 2, 64, torch.float32, False, None, 0),
    "norm_fp16_q2_fold_copy_draft": (3, 2, 6, 2, 64, torch.float16, True, "kv", 1),
    "norm_fp32_q2_fp8_fold_copy_token": (4, 2, 4, 1, 128, torch.float32, True, "fp8", 0),
    "fp16_q2_fold_no_copy": (2, 2, 2, 2, 32, torch.float16, False, "kv", None),
    "fp16_q2_fp8_fold_saturates": (3, 2, 4, 2, 32, torch.float16, False, "fp8", 1),  # keys past +-448
    # Summaries as the page pool holds them (`summary_arena`): a block's min and max side by side.
    "fp16_q2_fp8_fold_pool_views": (4, 2, 4, 2, 32, torch.float16, True, "fp8_pool", 1),
    # Prefill-sized launches (lowered here to 4 tokens): 3 tokens a program, the last one partial.
    "prefill_norm_fp32_7_tokens": (7, 1, 4, 2, 64, torch.float32, True, None, 0),
    "prefill_fp16_q2_fold_copy_10_tokens": (5, 2, 6, 2, 64, torch.float16, True, "kv", 1),
}


def make_case(R, Q, Hq, Hkv, D, dtype, norm, fold, draft, seed):
    gen = torch.Generator().manual_seed(seed)
    T, bs, NB = R * Q, 16, 3 * R
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen) * (300 if fold == "fp8" and not norm else 1)
    qkv = qkv.to(dtype)
    rot = RotaryEmbedding(D, 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (T,), generator=gen)
    qw = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype) if norm else None
    kw = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype) if norm else None
    cache = torch.randn(T * Hkv + 4, 2, bs, D, generator=gen).to(dtype)
    slots = torch.randperm(cache.shape[0], generator=gen)[:T * Hkv].view(T, Hkv).int()
    slots[1::Q] = -1 if Q > 1 else slots[1::Q]  # drafts are not stored
    offsets = torch.randint(0, bs, (T,), generator=gen).int()
    f = None
    if fold is not None:
        sdtype = torch.float8_e4m3fn if fold.startswith("fp8") else dtype
        lo = torch.randn(NB, Hkv, D, generator=gen)
        blocks = torch.randperm(NB, generator=gen)[:R]
        blocks[0] = -1  # a padding row
        first = torch.rand(R, generator=gen) < 0.5
        to = torch.full((R, Hq, D), float("nan")).to(dtype) if draft is not None else None
        kmin, kmax = lo.to(sdtype), (lo + lo.abs()).to(sdtype)
        if fold.endswith("_pool"):
            both = torch.stack([kmin, kmax], 1)  # [NB, 2, Hkv, D]
            kmin, kmax = both[:, 0], both[:, 1]
        f = SummaryFold(kmin, kmax, blocks, first, query_len=Q, draft_to=to, draft_index=draft or 0)
    return qkv, positions, rot.cos, rot.sin, qw, kw, cache, slots, offsets, f


def clone_fold(f):
    if f is None:
        return None
    return SummaryFold(f.kmin.clone(), f.kmax.clone(), f.block_ids, f.first_in_block, f.query_len,
                       None if f.draft_to is None else f.draft_to.clone(), f.draft_index)


def run_interpreter_cases() -> dict[str, float]:
    from oasiskv.kernels import qkv_epilogue as module
    errors = {}
    for name, (R, Q, Hq, Hkv, D, dtype, norm, fold, draft) in CASES.items():
        module.PREFILL_ROWS, module.PREFILL_TOKENS_PER_PROGRAM = (4, 3) if name.startswith("prefill") else (1024, 8)
        qkv, pos, cos, sin, qw, kw, cache, slots, offsets, f = make_case(R, Q, Hq, Hkv, D, dtype, norm, fold, draft,
                                                                         len(name))
        cache_ref, f_ref = cache.clone(), clone_fold(f)
        want = qkv_epilogue_ref(qkv, Hq, Hkv, pos, cos, sin, qw, kw, 1e-6, cache_ref, slots, offsets)
        got = qkv_epilogue_triton(qkv, Hq, Hkv, pos, cos, sin, qw, kw, 1e-6, cache, slots, offsets, f)
        if f_ref is not None:  # the kernel's own keys folded by torch: a key a rounding step off
            # can sit across an fp8 grid point from the reference's, and the keys are compared below
            update_block_minmax(f_ref.kmin, f_ref.kmax, f_ref.block_ids, got[1][0::Q], f_ref.first_in_block)
            if f_ref.draft_to is not None:
                f_ref.draft_to.copy_(want[0][f_ref.draft_index::Q])
        worst = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
        worst = max(worst, (cache.float() - cache_ref.float()).abs().max().item())
        if f is not None:
            for a, b in ((f.kmin, f_ref.kmin), (f.kmax, f_ref.kmax)):
                worst = max(worst, (a.float() - b.float()).abs().max().item())
            if f.draft_to is not None:
                worst = max(worst, (f.draft_to.float() - f_ref.draft_to.float()).abs().max().item())
        errors[name] = worst
    return errors


def fp8_grid_mismatches() -> int:
    """The kernel's fp8 rounding helpers on every finite e4m3 value, the midpoints between
    neighbours and points just beside them, zeros, subnormals and the saturation edge: values
    rounded toward -1 and +1, and the stored codes, against torch's `to_summary`."""
    import triton
    import triton.language as tl

    from oasiskv.kernels.summary_fold import to_summary

    @triton.jit
    def grid(x_ptr, lo_ptr, hi_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n)
        tl.store(lo_ptr + i, epilogue._fp8_bits(epilogue._fp8_toward(x, -1)), mask=i < n)
        tl.store(hi_ptr + i, epilogue._fp8_bits(epilogue._fp8_toward(x, 1)), mask=i < n)

    fp8 = torch.float8_e4m3fn
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    values = values[~values.isnan()].unique()
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, mids.nextafter(values[1:]), mids.nextafter(values[:-1]),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 447.9, -447.9, 448.0, -448.0])])
    lo, hi = (torch.empty(x.shape, dtype=fp8) for _ in range(2))
    grid[(1,)](x, lo, hi, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want_lo, want_hi = to_summary(x, fp8, -1), to_summary(x, fp8, 1)
    return int((lo.view(torch.uint8) != want_lo.view(torch.uint8)).sum() +
               (hi.view(torch.uint8) != want_hi.view(torch.uint8)).sum())


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_under_interpreter(__file__)
def test_fp8_rounding_on_the_grid(interpreter_errors):
    """Directed fp8 rounding as the kernel does it equals torch's, code for code, everywhere on
    e4m3's range (the kernel does not use Triton's float -> fp8 cast: the interpreter's differs)."""
    assert interpreter_errors["fp8_grid"] == 0


@pytest.mark.parametrize("name", list(CASES), ids=str)
def test_qkv_epilogue_interpreter(interpreter_errors, name):
    """The interpreter computes as the reference does (0 measured; fp8 summaries exactly torch's
    directed rounding); the bound allows one rounding step, as the GPU may fuse a*b - c*d into
    one multiply-add."""
    tol = {torch.float32: 1e-5, torch.float16: 2e-2}[CASES[name][5]]
    assert interpreter_errors[name] <= tol


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    print(json.dumps({**run_interpreter_cases(), "fp8_grid": fp8_grid_mismatches()}))
