"""Write new tokens' K/V into their cache slots: a Triton kernel (GPU) and the torch
reference (CPU). Semantics: `store_kv_ref` in reference.py."""
from __future__ import annotations

import torch

from oasiskv.kernels.reference import store_kv_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the reference alone
    triton = None


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             write_slots: torch.Tensor, write_offsets: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; write_slots: [T, Hkv] (-1 = skip); write_offsets: [T]."""
    if kv_cache.is_cuda:
        store_kv_triton(kv_cache, k, v, write_slots, write_offsets)
    else:
        store_kv_ref(kv_cache, k, v, write_slots, write_offsets)


if triton is not None:

    @triton.jit
    def _store_kv_kernel(kv_ptr, k_ptr, v_ptr, slot_ptr, off_ptr,
                         skv_slot, skv_kv, skv_tok, sk_t, sk_h, sv_t, sv_h, ss_t, ss_h, so_t,
                         D: tl.constexpr, DP: tl.constexpr):
        """One program per (token, kv head): one row of K and one of V."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slot_ptr + t * ss_t + h * ss_h).to(tl.int64)
        off = tl.load(off_ptr + t * so_t).to(tl.int64)
        d = tl.arange(0, DP)
        # A masked store rather than an early exit: slot -1 (e.g. a draft token) writes nothing.
        mask = (d < D) & (slot >= 0)
        k = tl.load(k_ptr + t * sk_t + h * sk_h + d, mask=d < D)
        v = tl.load(v_ptr + t * sv_t + h * sv_h + d, mask=d < D)
        dst = kv_ptr + slot * skv_slot + off * skv_tok + d
        tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + skv_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    write_slots: torch.Tensor, write_offsets: torch.Tensor) -> None:
    """Grid (T, Hkv); no host sync, so it can be captured in a CUDA graph."""
    T, H, D = k.shape
    if T == 0:
        return
    assert kv_cache.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    _store_kv_kernel[(T, H)](
        kv_cache, k, v, write_slots, write_offsets,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        write_slots.stride(0), write_slots.stride(1), write_offsets.stride(0),
        D=D, DP=triton.next_power_of_2(D), num_warps=1)
