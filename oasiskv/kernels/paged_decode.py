"""Head-wise paged decode attention: a vectorized torch path (CPU) and a Triton
flash-decoding kernel (GPU), both matching `paged_decode_ref` (reference.py).

Every (sequence, kv head) attends its own slot list (docs/design.md, "Memory layout"), so one
kernel serves dense and sparse requests. The GPU kernel is split-K ("flash decoding"): the slots of
one (sequence, head) are cut into `num_splits` ranges handled by separate programs,
whose partial softmax states are merged, together with the new tokens, by a second kernel.
With one split there is nothing to merge: the program attends the new tokens itself.
"""
from __future__ import annotations

import functools
import math
import os

import torch

LOG2E = 1.4426950408889634
# Software-pipeline stages of the split kernel. Triton (3.6, sm_90) gives the slot load the
# first stage and K/V the second, so 3 and 4 stages keep one K/V tile in flight per program
# and 5 keeps two (137 KiB of shared memory instead of 72 KiB: one program per SM, not three).
# 3 is the default; the pipelined sparse step asks for 5 where it fits
# (`pipeline.working_set_stages`).
DECODE_STAGES = 3


def paged_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 kv_cache: torch.Tensor, slot_tables: torch.Tensor, cache_lens: torch.Tensor,
                 scale: float, num_splits: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Triton on CUDA tensors (num_splits: the kernel's, None = `choose_num_splits`; num_stages:
    its software pipeline, None = `DECODE_STAGES`), vectorized torch otherwise. Shapes as in
    `paged_decode_ref`."""
    if q.is_cuda:
        return paged_decode_triton(q, k_new, v_new, kv_cache, slot_tables, cache_lens, scale, num_splits,
                                   num_stages=num_stages or DECODE_STAGES)
    return paged_decode_torch(q, k_new, v_new, kv_cache, slot_tables, cache_lens, scale)


# --------------------------------------------------------------------------- torch (CPU)

def paged_decode_torch(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                       kv_cache: torch.Tensor, slot_tables: torch.Tensor, cache_lens: torch.Tensor,
                       scale: float, chunk_blocks: int = 32) -> torch.Tensor:
    """All (sequence, head) pairs at once: gather slots into padded [B, Hkv, L, D] chunks,
    mask positions >= cache_len, batched matmuls, math in float32.

    The slot lists are walked in chunks of `chunk_blocks` with an online softmax rather than
    gathered whole: whole-context temporaries (50 MB at B=8, 4K tokens) are fresh allocations
    that page-fault on every call and fall out of cache; chunked, it ran 2-4x faster on 2 cores."""
    B, Q, Hq, D = q.shape
    Hkv = k_new.shape[2]
    G = Hq // Hkv
    num_slots, _, bs, _ = kv_cache.shape
    # Only walk up to the longest valid list in the batch (one host sync; fine on CPU).
    nblk = (int(cache_lens.max()) + bs - 1) // bs if cache_lens.numel() else 0

    # Rows of one kv head: its G query heads x Q tokens, row = g * Q + i.
    qf = q.float().view(B, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Q, D) * scale
    kn = k_new.float().permute(0, 2, 1, 3)  # [B, Hkv, Q, D]
    vn = v_new.float().permute(0, 2, 1, 3)
    # Start from the new tokens: every row sees new token 0, so the running max m is finite
    # from the outset and a chunk fully masked for some row cannot produce NaN.
    s = torch.matmul(qf, kn.transpose(-1, -2))  # [B, Hkv, G*Q, Q]
    qi = torch.arange(Q, device=q.device)
    causal = (qi[None, :] <= qi[:, None]).repeat(G, 1)  # [G*Q, Q]: query i sees new 0..i
    s.masked_fill_(~causal, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    acc = torch.matmul(p, vn)  # [B, Hkv, G*Q, D]

    lens = cache_lens[:, :, None, None].long()
    keys_all, vals_all = kv_cache[:, 0], kv_cache[:, 1]  # [num_slots, bs, D] views
    for c0 in range(0, nblk, chunk_blocks):
        c1 = min(c0 + chunk_blocks, nblk)
        # Entries past a list's valid count may be -1 or stale: clamp so the gather stays
        # in bounds; those positions are masked below.
        slots = slot_tables[:, :, c0:c1].long().clamp(0, num_slots - 1).reshape(-1)
        keys = keys_all.index_select(0, slots).view(B, Hkv, -1, D).float()
        vals = vals_all.index_select(0, slots).view(B, Hkv, -1, D).float()
        sc = torch.matmul(qf, keys.transpose(-1, -2))  # [B, Hkv, G*Q, chunk tokens]
        pos = torch.arange(c0 * bs, c1 * bs, device=q.device)
        past = pos >= lens  # [B, Hkv, 1, chunk tokens]
        sc.masked_fill_(past, float("-inf"))
        # Unwritten slots hold whatever the pool's memory held (it is never cleared): a weight
        # of 0 times an inf or NaN there is NaN, so those values are zeroed, not just unweighted.
        vals.masked_fill_(past.transpose(-1, -2), 0.0)
        m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
        alpha = torch.exp(m - m_new)
        p = torch.exp(sc - m_new)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vals)
        m = m_new
    out = (acc / l).view(B, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(B, Q, Hq, D)
    return out.to(q.dtype)


# --------------------------------------------------------------------------- Triton (GPU)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the torch path alone
    triton = None

if triton is not None:

    @triton.jit
    def _decode_split_kernel(
            q_ptr, kv_ptr, slot_ptr, len_ptr, pm_ptr, pl_ptr, pacc_ptr,
            sq_b, sq_q, sq_h,
            skv_slot, skv_kv, skv_tok,
            sst_b, sst_h, sl_b, sl_h,
            qk_scale, num_splits,
            kn_ptr, vn_ptr, out_ptr, skn_b, skn_q, skn_h, svn_b, svn_q, svn_h, so_b, so_q, so_h,
            G: tl.constexpr, Q: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
            M: tl.constexpr, TILE_BLKS: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr, SINGLE: tl.constexpr):
        """One program: (sequence b, kv head h, split s) over a contiguous range of its slots.
        Rows are the group's G query heads x Q tokens (row r = g * Q + i), padded to M.
        SINGLE (one split): the program also attends the new tokens and writes the output, so
        no merge launch follows."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        n = tl.load(len_ptr + b * sl_b + h * sl_h)
        nblk = tl.cdiv(n, BS)
        # Split range from the real length (on device, so graph replays adapt to it), rounded
        # to whole tiles so only the last tile of a list is partial.
        per_split = tl.cdiv(tl.cdiv(nblk, num_splits), TILE_BLKS) * TILE_BLKS
        blk_lo = s * per_split
        blk_hi = tl.minimum(blk_lo + per_split, nblk)

        rows = tl.arange(0, M)
        g = rows // Q
        i = rows % Q
        row_ok = rows < G * Q
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * sq_b + i[:, None] * sq_q + (h * G + g)[:, None] * sq_h + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        if UPCAST:  # bf16 dot is wrong in the interpreter: do it in fp32 there
            q = q.to(tl.float32)
        else:
            q = q.to(kv_ptr.dtype.element_ty)

        t = tl.arange(0, TILE_BLKS * BS)  # token index inside one tile
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        slot_row = slot_ptr + b * sst_b + h * sst_h
        for blk0 in range(blk_lo, blk_hi, TILE_BLKS):
            blk = blk0 + t // BS
            tok = blk * BS + t % BS
            ok = (blk < blk_hi) & (tok < n)
            slot = tl.load(slot_row + blk, mask=blk < blk_hi, other=0).to(tl.int64)
            base = kv_ptr + slot[:, None] * skv_slot + (t % BS)[:, None] * skv_tok + d[None, :]
            k = tl.load(base, mask=ok[:, None], other=0.0)
            v = tl.load(base + skv_kv, mask=ok[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            # Scores in the log2 domain (scale * log2 e folded in) so exp2 is used throughout.
            sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            sc = tl.where(ok[None, :], sc, float("-inf"))
            # Each tile holds >= 1 valid token, so m_new is finite and alpha never NaN.
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        if SINGLE:
            m_i, l_i, acc = _attend_new_tokens(q.to(tl.float32), m_i, l_i, acc, kn_ptr, vn_ptr, b, h, g, i,
                                               skn_b, skn_q, skn_h, svn_b, svn_q, svn_h, qk_scale, Q, D)
            out = acc / l_i[:, None]
            tl.store(out_ptr + b * so_b + i[:, None] * so_q + (h * G + g)[:, None] * so_h + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            # Partials of an empty split are never read: the merge stops at the last valid split.
            part = (b * tl.num_programs(1) + h) * num_splits + s
            tl.store(pm_ptr + part * M + rows, m_i, mask=row_ok)
            tl.store(pl_ptr + part * M + rows, l_i, mask=row_ok)
            tl.store(pacc_ptr + (part * M + rows[:, None]) * D + d[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def _decode_merge_kernel(
            q_ptr, kn_ptr, vn_ptr, len_ptr, pm_ptr, pl_ptr, pacc_ptr, out_ptr,
            sq_b, sq_q, sq_h, skn_b, skn_q, skn_h, svn_b, svn_q, svn_h, so_b, so_q, so_h,
            sl_b, sl_h, qk_scale, num_splits,
            G: tl.constexpr, Q: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
            M: tl.constexpr, MS: tl.constexpr, SC: tl.constexpr, TILE_BLKS: tl.constexpr):
        """One program per (sequence, kv head): merge the valid splits' (m, l, acc), then
        attend the Q new tokens (causal: query i sees new tokens 0..i) and normalise."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        n = tl.load(len_ptr + b * sl_b + h * sl_h)
        nblk = tl.cdiv(n, BS)
        per_split = tl.cdiv(tl.cdiv(nblk, num_splits), TILE_BLKS) * TILE_BLKS
        n_valid = tl.cdiv(nblk, tl.maximum(per_split, 1))  # same split ranges as the first kernel

        _merge_splits(q_ptr, kn_ptr, vn_ptr, pm_ptr, pl_ptr, pacc_ptr, out_ptr, b, h,
                      (b * tl.num_programs(1) + h) * num_splits, n_valid,
                      sq_b, sq_q, sq_h, skn_b, skn_q, skn_h, svn_b, svn_q, svn_h, so_b, so_q, so_h,
                      qk_scale, G, Q, D, M, MS, SC)

    @triton.jit
    def _merge_splits(q_ptr, kn_ptr, vn_ptr, pm_ptr, pl_ptr, pacc_ptr, out_ptr, b, h, part0, n_valid,
                      sq_b, sq_q, sq_h, skn_b, skn_q, skn_h, svn_b, svn_q, svn_h, so_b, so_q, so_h, qk_scale,
                      G: tl.constexpr, Q: tl.constexpr, D: tl.constexpr, M: tl.constexpr, MS: tl.constexpr,
                      SC: tl.constexpr):
        """(b, h)'s n_valid partials from part0 on, merged, then its new tokens, normalised and
        stored."""
        rows = tl.arange(0, MS)  # MS: rows padded to a power of two only (no tl.dot here)
        row_ok = rows < G * Q
        d = tl.arange(0, D)
        m_c = tl.full([MS], float("-inf"), tl.float32)
        l_c = tl.zeros([MS], tl.float32)
        acc = tl.zeros([MS, D], tl.float32)
        # SC splits per iteration, so their loads are in flight together (one memory latency
        # per SC splits, not per split).
        sc = tl.arange(0, SC)
        for s0 in range(0, n_valid, SC):
            ok = ((s0 + sc) < n_valid)[:, None] & row_ok[None, :]  # [SC, MS]
            off = (part0 + s0 + sc)[:, None] * M + rows[None, :]
            m_s = tl.load(pm_ptr + off, mask=ok, other=float("-inf"))
            l_s = tl.load(pl_ptr + off, mask=ok, other=0.0)
            a_s = tl.load(pacc_ptr + off[:, :, None] * D + d[None, None, :], mask=ok[:, :, None], other=0.0)
            m_new = tl.maximum(m_c, tl.max(m_s, 0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded rows: avoid inf - inf
            alpha = tl.exp2(m_c - m_ref)
            w = tl.exp2(m_s - m_ref[None, :])  # [SC, MS], 0 where masked
            l_c = l_c * alpha + tl.sum(w * l_s, 0)
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * a_s, 0)
            m_c = m_new

        g = rows // Q
        i = rows % Q
        q = tl.load(q_ptr + b * sq_b + i[:, None] * sq_q + (h * G + g)[:, None] * sq_h + d[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        m_c, l_c, acc = _attend_new_tokens(q, m_c, l_c, acc, kn_ptr, vn_ptr, b, h, g, i,
                                           skn_b, skn_q, skn_h, svn_b, svn_q, svn_h, qk_scale, Q, D)
        # Every row saw new token 0, so l_c > 0.
        out = acc / l_c[:, None]
        tl.store(out_ptr + b * so_b + i[:, None] * so_q + (h * G + g)[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _attend_new_tokens(q, m_c, l_c, acc, kn_ptr, vn_ptr, b, h, g, i, skn_b, skn_q, skn_h, svn_b, svn_q,
                           svn_h, qk_scale, Q: tl.constexpr, D: tl.constexpr):
        """The Q new tokens (at most 4) into a row block's online-softmax state (m, l, acc; log2
        domain), one at a time and causally: query i sees new tokens 0..i. q: [rows, D] float32."""
        d = tl.arange(0, D)
        for j in tl.static_range(Q):
            kn = tl.load(kn_ptr + b * skn_b + j * skn_q + h * skn_h + d).to(tl.float32)
            vn = tl.load(vn_ptr + b * svn_b + j * svn_q + h * svn_h + d).to(tl.float32)
            s_j = tl.sum(q * kn[None, :], 1) * qk_scale
            s_j = tl.where(i >= j, s_j, float("-inf"))
            m_new = tl.maximum(m_c, s_j)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded rows: avoid inf - inf
            alpha = tl.exp2(m_c - m_ref)
            p = tl.exp2(s_j - m_ref)
            l_c = l_c * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * vn[None, :]
            m_c = m_new
        return m_c, l_c, acc


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(batch_heads: int, max_blocks: int, num_sms: int,
                      tile_blocks: int = 8, min_tiles_per_split: int = 4, max_splits: int = 32) -> int:
    """Splits per (sequence, kv head), from static sizes only (graph capture: no host sync).

    Aim for about 8 programs per SM so small batches fill the GPU and the last wave is a
    small fraction of the work; keep each split at least a few tiles long so the merge
    stays negligible next to the KV reads (timings: docs/benchmarks.md, "Kernels alone")."""
    want = math.ceil(8 * num_sms / max(batch_heads, 1))
    most = max(1, max_blocks // (tile_blocks * min_tiles_per_split))
    return max(1, min(want, most, max_splits))


def paged_decode_triton(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                        kv_cache: torch.Tensor, slot_tables: torch.Tensor, cache_lens: torch.Tensor,
                        scale: float, num_splits: int | None = None, tile_blocks: int = 8,
                        num_warps: int = 4, num_stages: int = DECODE_STAGES,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Split-K flash decoding; same contract as `paged_decode_ref`. CUDA-graph capturable:
    launch sizes come from tensor shapes only, the valid lengths are read on device.
    `out` (optional, shaped like q) receives the result, e.g. a graph's static buffer.
    Defaults (8 blocks = 128 tokens a tile, 4 warps, 3 stages): the fastest of a sweep at
    batch 16, 32K context (docs/benchmarks.md, "Kernels alone")."""
    B, Q, Hq, D = q.shape
    Hkv = k_new.shape[2]
    G = Hq // Hkv
    bs = kv_cache.shape[2]
    assert Hq == G * Hkv and 1 <= Q <= 4 and D in (64, 128) and bs & (bs - 1) == 0
    assert kv_cache.stride(-1) == 1 and q.stride(-1) == 1 and k_new.stride(-1) == 1 \
        and v_new.stride(-1) == 1
    max_blocks = slot_tables.shape[2]
    if num_splits is None:
        sms = _num_sms(q.device.index or 0) if q.is_cuda else 132
        num_splits = choose_num_splits(B * Hkv, max_blocks, sms, tile_blocks)
    MS = triton.next_power_of_2(G * Q)
    M = max(16, MS)  # tl.dot needs >= 16 rows
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    upcast = interpret and kv_cache.dtype == torch.bfloat16
    precision = "ieee" if (upcast or kv_cache.dtype == torch.float32) else "tf32"
    qk_scale = scale * LOG2E

    if out is None:
        out = torch.empty_like(q)
    single = num_splits == 1
    parts = 0 if single else num_splits  # one split keeps no partials
    pm = torch.empty(B, Hkv, parts, M, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = torch.empty(B, Hkv, parts, M, D, device=q.device, dtype=torch.float32)
    # Splits merged per iteration: all in flight at once, within ~32 fp32 registers a thread.
    merge_chunk = min(triton.next_power_of_2(num_splits), max(1, 4096 // (MS * D)))
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, kv_cache, slot_tables, cache_lens, pm, pl, pacc,
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        slot_tables.stride(0), slot_tables.stride(1), cache_lens.stride(0), cache_lens.stride(1),
        qk_scale, num_splits,
        k_new, v_new, out, k_new.stride(0), k_new.stride(1), k_new.stride(2),
        v_new.stride(0), v_new.stride(1), v_new.stride(2), out.stride(0), out.stride(1), out.stride(2),
        G=G, Q=Q, D=D, BS=bs, M=M, TILE_BLKS=tile_blocks, UPCAST=upcast, PRECISION=precision, SINGLE=single,
        num_warps=num_warps, num_stages=num_stages)
    if single:
        return out
    _decode_merge_kernel[(B, Hkv)](
        q, k_new, v_new, cache_lens, pm, pl, pacc, out,
        q.stride(0), q.stride(1), q.stride(2), k_new.stride(0), k_new.stride(1), k_new.stride(2),
        v_new.stride(0), v_new.stride(1), v_new.stride(2), out.stride(0), out.stride(1), out.stride(2),
        cache_lens.stride(0), cache_lens.stride(1), qk_scale, num_splits,
        G=G, Q=Q, D=D, BS=bs, M=M, MS=MS, SC=merge_chunk, TILE_BLKS=tile_blocks,
        num_warps=8 if MS * D >= 2048 else 4)  # big row blocks spill registers at 4 warps
    return out
