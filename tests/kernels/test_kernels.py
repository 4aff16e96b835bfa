"""Attention kernels against their torch references (reference.py), on random inputs.

The vectorized torch path is compared directly. The Triton kernels run under Triton's CPU
interpreter (CONTRIBUTING.md), which must be switched on before triton is imported: they run in
one subprocess (this file executed as a script with TRITON_INTERPRET=1), so other test
modules in the same pytest process keep a normal triton. Interpreter cases use float16 and
float32 only: the interpreter's bf16 tl.dot is wrong; bf16 is checked on the GPU machine
(scripts/gpu_check_kernels.py).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from triton_interpreter import run_under_interpreter

from oasiskv.kernels.reference import paged_decode_ref

# Output tolerance by dtype: float32 math everywhere, so the gap is the output rounding
# (fp16/bf16) plus, in Triton, P cast to the cache dtype before the P @ V dot.
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_decode_inputs(B, Hkv, G, Q, D, max_blocks, dtype, bs=16, lens=None, seed=0):
    """Random q/k/v/cache, slots scattered by randperm, unused table entries set to -1,
    and cache lengths covering 0, 1, a partial last block, a full block and the maximum."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = B * Hkv * max_blocks + 5
    kv_cache = torch.randn(num_slots, 2, bs, D, generator=gen).to(dtype)
    slot_tables = torch.randperm(num_slots, generator=gen)[:B * Hkv * max_blocks]
    slot_tables = slot_tables.view(B, Hkv, max_blocks).to(torch.int32)
    if lens is None:
        special = [0, 1, bs + 3, bs, max_blocks * bs]
        lens = torch.randint(0, max_blocks * bs + 1, (B * Hkv,), generator=gen)
        lens[:len(special)] = torch.tensor(special[:B * Hkv])
        lens = lens[torch.randperm(B * Hkv, generator=gen)]
    cache_lens = torch.as_tensor(lens, dtype=torch.int32).view(B, Hkv)
    used = (cache_lens[:, :, None] + bs - 1) // bs
    slot_tables[torch.arange(max_blocks)[None, None, :] >= used] = -1  # must never be read
    q = torch.randn(B, Q, G * Hkv, D, generator=gen).to(dtype)
    k_new = torch.randn(B, Q, Hkv, D, generator=gen).to(dtype)
    v_new = torch.randn(B, Q, Hkv, D, generator=gen).to(dtype)
    return q, k_new, v_new, kv_cache, slot_tables, cache_lens


# ----------------------------------------------------------------- torch path vs reference

TORCH_CASES = [  # B, Hkv, G, Q, D, max_blocks, dtype
    (3, 2, 3, 1, 64, 7, torch.float32),
    (2, 3, 4, 2, 64, 9, torch.float32),
    (4, 1, 1, 4, 128, 3, torch.float32),
    (2, 2, 8, 2, 128, 40, torch.float32),  # more than one chunk of 32 blocks
    (2, 3, 3, 2, 64, 5, torch.bfloat16),
    (3, 2, 4, 1, 128, 6, torch.float16),
]


@pytest.mark.parametrize("case", TORCH_CASES, ids=str)
def test_paged_decode_torch_matches_ref(case):
    from oasiskv.kernels.paged_decode import paged_decode_torch
    B, Hkv, G, Q, D, max_blocks, dtype = case
    args = make_decode_inputs(B, Hkv, G, Q, D, max_blocks, dtype, seed=B * 100 + G)
    scale = D ** -0.5
    out = paged_decode_torch(*args, scale)
    ref = paged_decode_ref(*args, scale)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_paged_decode_torch_ignores_what_unwritten_slots_hold():
    """The pool is never cleared: slots past a list's cache length may hold inf or NaN from
    earlier use of the memory. They must not reach the output (0 * inf is NaN)."""
    from oasiskv.kernels.paged_decode import paged_decode_torch
    B, Hkv, G, Q, D, max_blocks, bs = 2, 2, 3, 2, 64, 5, 16
    q, k_new, v_new, kv_cache, tables, _ = make_decode_inputs(B, Hkv, G, Q, D, max_blocks, torch.float32, seed=7)
    lens = torch.tensor([[bs + 3, 2 * bs + 9], [5, 3 * bs + 1]], dtype=torch.int32)  # partial last blocks
    # Every list names distinct real slots, past its length too.
    gen = torch.Generator().manual_seed(8)
    tables = torch.randperm(kv_cache.shape[0], generator=gen)[:B * Hkv * max_blocks].view(B, Hkv, -1).int()
    want = paged_decode_ref(q, k_new, v_new, kv_cache, tables, lens, D ** -0.5)
    poisoned = kv_cache.clone()
    for b in range(B):
        for h in range(Hkv):
            flat = poisoned[tables[b, h].long()].transpose(0, 1).reshape(2, -1, D)  # [2, tokens, D]
            flat[:, int(lens[b, h]):] = float("nan")
            flat[1, int(lens[b, h]):int(lens[b, h]) + 1] = float("inf")
            poisoned[tables[b, h].long()] = flat.view(2, max_blocks, bs, D).transpose(0, 1)
    got = paged_decode_torch(q, k_new, v_new, poisoned, tables, lens, D ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_dispatch_on_cpu_uses_torch_paths():
    from oasiskv.kernels.paged_decode import paged_decode
    args = make_decode_inputs(2, 2, 2, 2, 64, 4, torch.float32)
    torch.testing.assert_close(paged_decode(*args, 0.1), paged_decode_ref(*args, 0.1),
                               rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------- Triton under the interpreter

DECODE_CASES = {  # id: (B, Hkv, G, Q, D, max_blocks, dtype, kernel options)
    "g1_q1_fp32_split2": (2, 2, 1, 1, 64, 5, torch.float32, dict(num_splits=2)),
    "g3_q2_fp16_split3": (2, 2, 3, 2, 64, 6, torch.float16, dict(num_splits=3)),
    "g4_q2_d128_fp32_auto": (2, 1, 4, 2, 128, 4, torch.float32, {}),
    "g4_q4_fp16_split4": (1, 3, 4, 4, 64, 9, torch.float16, dict(num_splits=4)),
    "g8_q4_fp32_split1": (1, 2, 8, 4, 64, 3, torch.float32, dict(num_splits=1)),
    # one split: the new tokens and the output in the split kernel, no merge launch
    "g4_q2_fp16_split1_tile2": (2, 2, 4, 2, 64, 7, torch.float16, dict(num_splits=1, tile_blocks=2)),
    # several tiles per split, partial tiles at split ends
    "g2_q1_fp16_tile2_split2": (2, 2, 2, 1, 64, 11, torch.float16, dict(num_splits=2, tile_blocks=2)),
}


def run_interpreter_cases() -> dict[str, float]:
    """Runs in the TRITON_INTERPRET=1 subprocess: max abs error of each case vs its reference."""
    from oasiskv.kernels.paged_decode import paged_decode_triton
    errors = {}
    for name, (B, Hkv, G, Q, D, max_blocks, dtype, options) in DECODE_CASES.items():
        args = make_decode_inputs(B, Hkv, G, Q, D, max_blocks, dtype, seed=len(name))
        ref = paged_decode_ref(*args, D ** -0.5)
        out = torch.full_like(args[0], float("nan"))  # poisoned: every element must be written
        paged_decode_triton(*args, D ** -0.5, out=out, **options)
        errors["decode_" + name] = (out.float().nan_to_num(1e4) - ref.float()).abs().max().item()
    return errors


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_under_interpreter(__file__)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DECODE_CASES), ids=str)
def test_paged_decode_triton_interpreter(interpreter_errors, name):
    assert interpreter_errors["decode_" + name] < TOL[DECODE_CASES[name][6]]


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    print(json.dumps(run_interpreter_cases()))
