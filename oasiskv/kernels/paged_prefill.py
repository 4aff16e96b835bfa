"""Chunked prefill attention over the paged KV cache: a Triton FlashAttention-2 kernel (GPU)
and a torch path (CPU), both matching `paged_prefill_ref` (reference.py).

A prefill step is a list of chunks, one per sequence: query rows [start, start + length) of the
step sit at positions [prefix_len, prefix_len + length) of their sequence, and attend every
position up to their own (causal). The chunk's own K/V are already in the cache (the qkv
epilogue stores them before attention), so every key and value is read from the pages, through
the sequence's row of the page table: no gather, no mask tensor, and the first chunk of a
sequence (prefix_len 0) is no special case. All chunks of a step go in one launch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from oasiskv.kernels import cudnn_prefill

LOG2E = 1.4426950408889634


@dataclass
class PrefillTable:
    """The chunks of one prefill step, on the model's device, built once and read by every layer.

    chunks: [N, 4] int32, per chunk (query start, length, prefix_len, page-table row);
    page_table: [R, max_pages] int32, row r: the page ids of one sequence in position order,
    covering at least positions [0, prefix_len + length) of its chunk (later entries unread);
    max_len: the longest chunk (host int: the kernel's grid);
    spans: per chunk (query start, length, prefix_len) on the host."""
    chunks: torch.Tensor
    page_table: torch.Tensor
    max_len: int
    spans: list[tuple[int, int, int]]
    _subsets: dict = field(default_factory=dict, repr=False)  # built once a step, read by every layer

    @classmethod
    def build(cls, starts: list[int], lengths: list[int], prefix_lens: list[int],
              pages: list[list[int]], device: torch.device) -> "PrefillTable":
        """One row of the page table per chunk (chunk i reads row i)."""
        n = len(starts)
        # Rows padded to a multiple of 16 pages: the kernel's row stride then specializes alike
        # whatever the prompts' lengths (one compiled variant, built at start-up, not per new length).
        width = -(-max((len(p) for p in pages), default=1) // 16) * 16 or 16
        page_table = np.zeros((n, width), dtype=np.int32)
        for i, p in enumerate(pages):
            page_table[i, :len(p)] = p
        chunks = np.array([starts, lengths, prefix_lens, list(range(n))], dtype=np.int32).T.copy()
        return cls(_to_device(chunks, device), _to_device(page_table, device), max(lengths, default=0),
                   list(zip(starts, lengths, prefix_lens)))

    def subset(self, keep: list[int]) -> "PrefillTable":
        """The chunks numbered in `keep` alone (their page-table rows unchanged); built on the
        first layer's call, reused by the others."""
        key = tuple(keep)
        if key not in self._subsets:
            spans = [self.spans[i] for i in keep]
            rows = self.chunks[torch.tensor(keep, device=self.chunks.device)]
            self._subsets[key] = PrefillTable(rows, self.page_table, max(n for _, n, _ in spans), spans)
        return self._subsets[key]


def _to_device(x: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(x)
    # Pinned and async on CUDA: a pageable copy would wait for the step in flight.
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, table: PrefillTable, num_kv_heads: int,
                  scale: float, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]: Triton on CUDA tensors and under Triton's interpreter (so the
    engine's prefill runs the kernel in a CPU test), torch otherwise. On a GPU with cuDNN's
    fused attention, long chunks go there instead (cudnn_prefill.py: faster at those sizes),
    reading their own keys and values from k, v [T, Hkv, D] when given (as stored in the pages)."""
    if not (triton is not None and (q.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1")):
        return paged_prefill_torch(q, kv_cache, table, num_kv_heads, scale)
    to_cudnn = []
    if cudnn_prefill.cudnn_usable(q):
        to_cudnn = [i for i, (_, n, p) in enumerate(table.spans) if cudnn_prefill.takes_chunk(p, n)]
    if not to_cudnn:
        return paged_prefill_triton(q, kv_cache, table, num_kv_heads, scale)
    def on_cudnn(i: int) -> torch.Tensor:
        start, n, prefix = table.spans[i]
        own = (k[start:start + n], v[start:start + n]) if k is not None and v is not None else None
        return cudnn_prefill.chunk_attention(q[start:start + n], kv_cache, table.page_table[i], prefix,
                                             num_kv_heads, scale, own_kv=own)

    if len(table.spans) == 1 and table.spans[0][1] == q.shape[0]:
        return on_cudnn(0)  # one chunk, the whole step: its output as it comes
    out = torch.empty_like(q)
    rest = sorted(set(range(len(table.spans))) - set(to_cudnn))
    if rest:
        paged_prefill_triton(q, kv_cache, table.subset(rest), num_kv_heads, scale, out=out)
    for i in to_cudnn:
        start, n, _ = table.spans[i]
        out[start:start + n] = on_cudnn(i)
    return out


# --------------------------------------------------------------------------- torch (CPU)

def paged_prefill_torch(q: torch.Tensor, kv_cache: torch.Tensor, table: PrefillTable, num_kv_heads: int,
                        scale: float) -> torch.Tensor:
    """One SDPA per chunk over its keys gathered from the pages (the chunk table is read on the
    host: free on CPU, a sync on a GPU)."""
    out = torch.empty_like(q)
    Hkv, bs, D = num_kv_heads, kv_cache.shape[2], kv_cache.shape[3]
    pages_view = kv_cache.view(-1, Hkv, 2, bs, D)
    for start, length, prefix, row in table.chunks.tolist():
        n = prefix + length
        pages = table.page_table[row, :(n + bs - 1) // bs].long()
        kv = pages_view[pages].permute(2, 1, 0, 3, 4).reshape(2, Hkv, -1, D)[:, :, :n].to(q.dtype)
        qc = q[start:start + length].transpose(0, 1)[None]  # [1, Hq, L, D]
        if prefix == 0:
            o = F.scaled_dot_product_attention(qc, kv[0][None], kv[1][None], is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:  # causal with the chunk's offset: query i sees positions 0 .. prefix + i
            i = torch.arange(length, device=q.device)[:, None]
            j = torch.arange(n, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(qc, kv[0][None], kv[1][None], attn_mask=j <= prefix + i,
                                               scale=scale, enable_gqa=True)
        out[start:start + length] = o[0].transpose(0, 1)
    return out


# --------------------------------------------------------------------------- Triton (GPU)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the torch path alone
    triton = None

if triton is not None:

    @triton.jit
    def _online_softmax(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
        """One key tile's scores s (log2 domain) and values v into the rows' (m, l, acc)."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _prefill_kernel(
            q_ptr, kv_ptr, out_ptr, chunk_ptr, page_ptr,
            sq_t, sq_h, so_t, so_h, skv_slot, skv_kv, skv_tok, s_pt,
            qk_scale,
            HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
            TOK: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """One program: (kv head h, chunk c, query tile) -> TOK tokens x the G query heads of h,
        row r = token (r // G) and head h * G + r % G, padded to M rows. Keys in tiles of
        BLOCK_N positions: those every row sees first (no mask), then the causal diagonal."""
        h = tl.program_id(0)
        c = tl.program_id(1)
        tile = tl.num_programs(2) - 1 - tl.program_id(2)  # the longest (last) tiles start first
        start = tl.load(chunk_ptr + c * 4)
        length = tl.load(chunk_ptr + c * 4 + 1)
        prefix = tl.load(chunk_ptr + c * 4 + 2)
        row = tl.load(chunk_ptr + c * 4 + 3).to(tl.int64)
        t0 = tile * TOK
        if t0 >= length:
            return
        rows = tl.arange(0, M)
        tok = t0 + rows // G
        row_ok = (rows < TOK * G) & (tok < length)
        head = h * G + rows % G
        d = tl.arange(0, D)
        tok_row = (start + tok).to(tl.int64)
        q = tl.load(q_ptr + tok_row[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        if UPCAST:  # bf16 dot is wrong in the interpreter: do it in fp32 there
            q = q.to(tl.float32)
        else:
            q = q.to(kv_ptr.dtype.element_ty)
        qpos = prefix + tok  # each row's position in its sequence

        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        n_i = tl.arange(0, BLOCK_N)
        pt_row = page_ptr + row * s_pt
        # Positions 0 .. prefix + t0 are seen by every row of the tile.
        full_end = (prefix + t0 + 1) // BLOCK_N * BLOCK_N
        kv_end = prefix + tl.minimum(t0 + TOK, length)  # one past the last row's position
        for n0 in range(0, full_end, BLOCK_N):
            pos = n0 + n_i
            page = tl.load(pt_row + pos // BS).to(tl.int64)
            base = kv_ptr + (page * HKV + h)[:, None] * skv_slot + (pos % BS)[:, None] * skv_tok + d[None, :]
            k = tl.load(base)
            v = tl.load(base + skv_kv)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            # Scores in the log2 domain (scale * log2 e folded in) so exp2 is used throughout.
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, PRECISION)
        for n0 in range(full_end, kv_end, BLOCK_N):
            pos = n0 + n_i
            ok = pos < kv_end  # past it: unwritten memory, never loaded (0 * NaN is NaN)
            page = tl.load(pt_row + pos // BS, mask=ok, other=0).to(tl.int64)
            base = kv_ptr + (page * HKV + h)[:, None] * skv_slot + (pos % BS)[:, None] * skv_tok + d[None, :]
            k = tl.load(base, mask=ok[:, None], other=0.0)
            v = tl.load(base + skv_kv, mask=ok[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            # Causal: row r sees positions <= qpos[r]. Every row sees position full_end (<= its
            # own), so the first tile here leaves each row's max finite if none came before.
            s = tl.where(pos[None, :] <= qpos[:, None], s, float("-inf"))
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, PRECISION)

        out = acc / l_i[:, None]
        tl.store(out_ptr + tok_row[:, None] * so_t + head[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def warm_up(kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int, dtype: torch.dtype, scale: float) -> None:
    """Build the Triton kernel now, on one block-sized chunk that reads page 0 and writes no
    page: every prefill step then uses this variant (page-table rows padded to 16 pages)."""
    if triton is None or not kv_cache.is_cuda:
        return
    bs, D = kv_cache.shape[2], kv_cache.shape[3]
    q = torch.zeros(bs, num_heads, D, dtype=dtype, device=kv_cache.device)
    paged_prefill_triton(q, kv_cache, PrefillTable.build([0], [bs], [0], [[0]], kv_cache.device), num_kv_heads, scale)


def paged_prefill_triton(q: torch.Tensor, kv_cache: torch.Tensor, table: PrefillTable, num_kv_heads: int,
                         scale: float, rows: int = 128, block_n: int | None = None, num_warps: int = 4,
                         num_stages: int = 3, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's path (any device under TRITON_INTERPRET=1: the tests); same contract as
    `paged_prefill_ref`. rows: query rows a program holds (tokens x the group's heads, a power
    of two >= 16); block_n: key positions per tile (a multiple of the block size, or a divisor;
    None: 64, or 32 for a float32 cache, whose tiles take twice the shared memory)."""
    if block_n is None:
        block_n = 64 if kv_cache.element_size() <= 2 else 32
    T, Hq, D = q.shape
    Hkv = num_kv_heads
    G = Hq // Hkv
    bs = kv_cache.shape[2]
    assert Hq == G * Hkv and D in (64, 128) and bs & (bs - 1) == 0 and rows & (rows - 1) == 0
    assert rows >= max(16, G) and block_n >= 16 and (block_n % bs == 0 or bs % block_n == 0)
    assert kv_cache.stride(-1) == 1 and q.stride(-1) == 1 and table.chunks.is_contiguous()
    if out is None:
        out = torch.empty_like(q)
    n_chunks = table.chunks.shape[0]
    tok = rows // G
    if T == 0 or n_chunks == 0:
        return out
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    upcast = interpret and kv_cache.dtype == torch.bfloat16
    precision = "ieee" if (upcast or kv_cache.dtype == torch.float32) else "tf32"
    grid = (Hkv, n_chunks, triton.cdiv(table.max_len, tok))
    _prefill_kernel[grid](
        q, kv_cache, out, table.chunks, table.page_table,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), table.page_table.stride(0),
        scale * LOG2E,
        HKV=Hkv, G=G, D=D, BS=bs, TOK=tok, M=rows, BLOCK_N=block_n, UPCAST=upcast, PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages)
    return out
