"""Everything between the qkv projection and attention, in one launch on CUDA: each head's
RMSNorm (Qwen3's q/k norm), RoPE, the new K/V stored into their cache slots and, for the
sparse pipeline, each row's key folded into its block's min/max summary and its draft query
copied out for the predict stage.

One launch instead of four a layer (norm + RoPE, store, fold), all on the decode step's
critical path. `qkv_epilogue_ref` composes the separate functions and is what CPU tensors run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from oasiskv.kernels.reference import rms, rotate_half, store_kv_ref
from oasiskv.kernels.summary_fold import update_block_minmax

# A prefill-sized launch (from PREFILL_ROWS tokens) gives each program this many tokens of a head,
# so a 32K-token chunk is not 1.3M programs of 256 bytes each.
PREFILL_ROWS, PREFILL_TOKENS_PER_PROGRAM = 1024, 8

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the reference alone
    triton = None


@dataclass(frozen=True, slots=True)
class SummaryFold:
    """The sparse pipeline's part of a layer's epilogue, for a step of R rows x Q tokens: row
    r's token (token r * Q) folds its key into block block_ids[r] of kmin / kmax [NB, Hkv, D]
    (-1: skip the row; first_in_block: the token starts the block), and token r * Q +
    draft_index's query goes to draft_to[r] ([R, Hq, D]; None: no copy)."""
    kmin: torch.Tensor
    kmax: torch.Tensor
    block_ids: torch.Tensor
    first_in_block: torch.Tensor
    query_len: int
    draft_to: torch.Tensor | None = None
    draft_index: int = 1


def qkv_epilogue(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, kv_cache: torch.Tensor,
                 write_slots: torch.Tensor, write_offsets: torch.Tensor,
                 fold: SummaryFold | None = None):
    """qkv [T, (Hq + 2 Hkv) * D] -> q [T, Hq, D], k [T, Hkv, D] (normed if weights are given,
    rotated), v [T, Hkv, D] (a view of qkv); K/V stored at write_slots / write_offsets (-1:
    not stored) and `fold` applied."""
    if not qkv.is_cuda or triton is None:
        return qkv_epilogue_ref(qkv, num_heads, num_kv_heads, positions, cos, sin, q_weight, k_weight, eps,
                                kv_cache, write_slots, write_offsets, fold)
    return qkv_epilogue_triton(qkv, num_heads, num_kv_heads, positions, cos, sin, q_weight, k_weight, eps,
                               kv_cache, write_slots, write_offsets, fold)


def qkv_epilogue_triton(qkv, num_heads, num_kv_heads, positions, cos, sin, q_weight, k_weight, eps,
                        kv_cache, write_slots, write_offsets, fold=None):
    """`qkv_epilogue`'s kernel path (any device under TRITON_INTERPRET=1: the tests)."""
    T = qkv.shape[0]
    Hq, Hkv = num_heads, num_kv_heads
    D = qkv.shape[1] // (Hq + 2 * Hkv)
    half = D // 2
    assert qkv.stride(1) == 1 and kv_cache.stride(-1) == 1 and D % 2 == 0 and half & (half - 1) == 0, \
        "the kernel takes head dims 2 * 2^n, rows and cache contiguous in the head dim"
    q = torch.empty(T, Hq, D, device=qkv.device, dtype=qkv.dtype)
    k = torch.empty(T, Hkv, D, device=qkv.device, dtype=qkv.dtype)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    if T == 0:
        return q, k, v
    norm = q_weight is not None
    f = fold  # short: it is named many times below
    copy = f is not None and f.draft_to is not None
    if copy:
        assert f.draft_to.is_contiguous() and f.draft_to.shape[1:] == (Hq, D)
    if f is not None:  # [NB, Hkv, D] with any block stride (the page pool's views: `summary_arena`)
        assert f.kmin.stride() == f.kmax.stride() and f.kmin.stride()[1:] == (D, 1)
    tokens = PREFILL_TOKENS_PER_PROGRAM if T >= PREFILL_ROWS else 1
    _qkv_epilogue_kernel[(triton.cdiv(T, tokens), Hq + Hkv)](
        qkv, q, k, positions, cos, sin, q_weight if norm else qkv, k_weight if norm else qkv,
        kv_cache, write_slots, write_offsets,
        f.kmin if f is not None else qkv, f.kmax if f is not None else qkv,
        f.block_ids if f is not None else positions, f.first_in_block if f is not None else positions,
        f.draft_to if copy else qkv,
        qkv.stride(0), cos.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        write_slots.stride(0), write_slots.stride(1), f.kmin.stride(0) if f is not None else 0, eps,
        HQ=Hq, HKV=Hkv, D=D, HALF=half, NORM=norm, FOLD=f is not None, COPY=copy,
        Q=f.query_len if f is not None else 1, DRAFT=f.draft_index if copy else 0,
        FP8=f is not None and f.kmin.dtype == torch.float8_e4m3fn, T=T, TOKENS=tokens, num_warps=1)
    return q, k, v


def qkv_epilogue_ref(qkv, num_heads, num_kv_heads, positions, cos, sin, q_weight, k_weight, eps,
                     kv_cache, write_slots, write_offsets, fold=None):
    T = qkv.shape[0]
    D = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q, k, v = q.view(T, num_heads, D), k.view(T, num_kv_heads, D), v.view(T, num_kv_heads, D)
    if q_weight is not None:
        q, k = rms(q, q_weight, eps), rms(k, k_weight, eps)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    q, k = rotate_half(q, c, s), rotate_half(k, c, s)
    store_kv_ref(kv_cache, k, v, write_slots, write_offsets)
    if fold is not None:
        Q = fold.query_len
        update_block_minmax(fold.kmin, fold.kmax, fold.block_ids, k[0::Q], fold.first_in_block)
        if fold.draft_to is not None:
            fold.draft_to.copy_(q[fold.draft_index::Q])
    return q, k, v


if triton is not None:

    @triton.jit
    def _qkv_epilogue_kernel(qkv_ptr, q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                             kv_ptr, slot_ptr, off_ptr, kmin_ptr, kmax_ptr, block_ptr, first_ptr, draft_ptr,
                             s_qkv, s_cos, skv_slot, skv_kv, skv_tok, ss_t, ss_h, s_sb, eps,
                             HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                             NORM: tl.constexpr, FOLD: tl.constexpr, COPY: tl.constexpr, Q: tl.constexpr,
                             DRAFT: tl.constexpr, FP8: tl.constexpr, T, TOKENS: tl.constexpr):
        """One program per (TOKENS tokens from t, head j): j < HQ a query head, else kv head j - HQ.
        The two halves of the head are loaded apart, as rotate-half pairs element i with i + D/2."""
        j = tl.program_id(1)
        i = tl.arange(0, HALF)
        is_q = j < HQ
        for n in tl.static_range(TOKENS):
            t = tl.program_id(0) * TOKENS + n
            if t < T:
                src = qkv_ptr + t.to(tl.int64) * s_qkv + j * D  # k heads follow q heads, v follows k
                x1 = tl.load(src + i).to(tl.float32)
                x2 = tl.load(src + HALF + i).to(tl.float32)
                if NORM:  # as reference.rms: float32 math, the result in the model dtype
                    w_ptr = tl.where(is_q, qw_ptr, kw_ptr)
                    r = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
                    x1 = (x1 * r * tl.load(w_ptr + i).to(tl.float32)).to(q_ptr.dtype.element_ty).to(tl.float32)
                    x2 = (x2 * r * tl.load(w_ptr + HALF + i).to(tl.float32)).to(q_ptr.dtype.element_ty).to(tl.float32)
                pos = tl.load(pos_ptr + t).to(tl.int64)
                c1 = tl.load(cos_ptr + pos * s_cos + i)
                c2 = tl.load(cos_ptr + pos * s_cos + HALF + i)
                s1 = tl.load(sin_ptr + pos * s_cos + i)
                s2 = tl.load(sin_ptr + pos * s_cos + HALF + i)
                y1 = (x1 * c1 - x2 * s1).to(q_ptr.dtype.element_ty)
                y2 = (x2 * c2 + x1 * s2).to(q_ptr.dtype.element_ty)
                if is_q:
                    dst = q_ptr + (t.to(tl.int64) * HQ + j) * D
                    tl.store(dst + i, y1)
                    tl.store(dst + HALF + i, y2)
                    if COPY:
                        if t % Q == DRAFT:
                            dst = draft_ptr + ((t // Q).to(tl.int64) * HQ + j) * D
                            tl.store(dst + i, y1)
                            tl.store(dst + HALF + i, y2)
                else:
                    h = j - HQ
                    dst = k_ptr + (t.to(tl.int64) * HKV + h) * D
                    tl.store(dst + i, y1)
                    tl.store(dst + HALF + i, y2)
                    slot = tl.load(slot_ptr + t * ss_t + h * ss_h).to(tl.int64)
                    if slot >= 0:
                        off = tl.load(off_ptr + t).to(tl.int64)
                        cache = kv_ptr + slot * skv_slot + off * skv_tok
                        tl.store(cache + i, y1.to(kv_ptr.dtype.element_ty))
                        tl.store(cache + HALF + i, y2.to(kv_ptr.dtype.element_ty))
                        v1 = tl.load(src + HKV * D + i)
                        v2 = tl.load(src + HKV * D + HALF + i)
                        tl.store(cache + skv_kv + i, v1.to(kv_ptr.dtype.element_ty))
                        tl.store(cache + skv_kv + HALF + i, v2.to(kv_ptr.dtype.element_ty))
                    if FOLD:
                        if t % Q == 0:
                            b = tl.load(block_ptr + t // Q).to(tl.int64)
                            if b >= 0:
                                _fold(kmin_ptr, kmax_ptr, b * s_sb + h * D, y1, y2, i, HALF,
                                      tl.load(first_ptr + t // Q) != 0, FP8)

    @triton.jit
    def _fp8_toward(x, TOWARD: tl.constexpr):
        """x (float32, within +-448) as the e4m3 value next to it upward (TOWARD 1) or downward
        (-1), in float32 (`summary_fold.to_summary`). Found on e4m3's grid by arithmetic, not by
        Triton's float -> fp8 cast, which the interpreter rounds differently (1.99 -> 1.125)."""
        e = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals: 2^-6's step
        step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): 3 mantissa bits
        inv = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 1 / step, exactly
        n = tl.ceil(x * inv) if TOWARD > 0 else tl.floor(x * inv)
        return n * step

    @triton.jit
    def _fp8_bits(v):
        """v (float32, a value e4m3 holds exactly) as that e4m3 value, built from its bits."""
        b = v.to(tl.int32, bitcast=True)
        sign = (b >> 24) & 0x80
        e = ((b >> 23) & 0xFF) - 127
        normal = ((e + 7) << 3) | ((b >> 20) & 7)
        sub = (tl.abs(v) * 512.0).to(tl.int32)  # e4m3 subnormals are multiples of 2^-9
        code = sign | tl.where(e >= -6, normal, sub)
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)

    @triton.jit
    def _fold(kmin_ptr, kmax_ptr, at, y1, y2, i, HALF: tl.constexpr, first, FP8: tl.constexpr):
        """As `summary_fold.update_block_minmax` for one token: the key into its block's min / max
        (a new block starts from the key); fp8 summaries saturate at +-448 (e4m3 has no inf),
        take the key rounded down into the min and up into the max, and compare in float32."""
        for part in tl.static_range(2):
            y = y1 if part == 0 else y2
            p = at + part * HALF + i
            lo = tl.load(kmin_ptr + p)
            hi = tl.load(kmax_ptr + p)
            if FP8:
                x = tl.minimum(tl.maximum(y.to(tl.float32), -448.0), 448.0)
                k_lo = _fp8_toward(x, -1)
                k_hi = _fp8_toward(x, 1)
                lo = lo.to(tl.float32)
                hi = hi.to(tl.float32)
            else:
                k_lo = y.to(lo.dtype)
                k_hi = k_lo
            lo = tl.where(first, k_lo, tl.minimum(lo, k_lo))
            hi = tl.where(first, k_hi, tl.maximum(hi, k_hi))
            if FP8:
                tl.store(kmin_ptr + p, _fp8_bits(lo))
                tl.store(kmax_ptr + p, _fp8_bits(hi))
            else:
                tl.store(kmin_ptr + p, lo.to(kmin_ptr.dtype.element_ty))
                tl.store(kmax_ptr + p, hi.to(kmax_ptr.dtype.element_ty))
