"""The one-pass merge of two attention parts (oasiskv/kernels/merge_attention.py) against the
torch formula, under Triton's CPU interpreter (a subprocess): strided parts as cuDNN returns
them, a query count that is not a multiple of the block, a head dim below its power of two;
and the merged whole against attention over all keys at once."""
from __future__ import annotations

import json
import os

import pytest
import torch
from triton_interpreter import run_under_interpreter

from oasiskv.kernels.merge_attention import merge_parts_torch


def parts(q, k, v, scale):
    """(out [H, L, D], lse [H, L]) of q [H, L, D] over k, v [H, S, D], no mask."""
    s = (q.float() @ k.float().transpose(1, 2)) * scale
    return torch.softmax(s, -1) @ v.float(), torch.logsumexp(s, -1)


def test_torch_merge_equals_attention_over_all_keys():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, n, 16, generator=gen) for n in (5, 11, 11))
    own, own_lse = parts(q, k[:, :4], v[:, :4], 0.25)
    pre, pre_lse = parts(q, k[:, 4:], v[:, 4:], 0.25)
    whole, _ = parts(q, k, v, 0.25)
    torch.testing.assert_close(merge_parts_torch(own, own_lse, pre, pre_lse, torch.float32),
                               whole.transpose(0, 1), atol=1e-5, rtol=1e-5)


def compare() -> dict:
    from oasiskv.kernels.merge_attention import merge_parts
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, (H, L, D, dtype) in {"fp32": (3, 45, 24, torch.float32), "bf16": (4, 70, 64, torch.bfloat16)}.items():
        own = torch.randn(L, H, D, generator=gen).to(dtype).transpose(0, 1)  # [H, L, D], strided
        pre = torch.randn(H, L, D + 8, generator=gen).to(dtype)[:, :, :D]  # rows padded
        own_lse = torch.randn(H, L, generator=gen) * 3
        pre_lse = torch.randn(L, H, generator=gen).t() * 3  # strided
        ref = merge_parts_torch(own, own_lse, pre, pre_lse, dtype)
        got = merge_parts(own, own_lse, pre, pre_lse, dtype, kernel=True)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        out[name] = got.shape == ref.shape and torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)
    return out


@pytest.mark.slow
def test_merge_kernel_matches_torch():
    assert run_under_interpreter(__file__) == {"fp32": True, "bf16": True}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    print(json.dumps(compare()))
