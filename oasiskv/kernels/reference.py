"""Torch references of the kernels, and of the RMSNorm and RoPE the qkv epilogue fuses: the
semantics every fast kernel must match.

KV cache layout (docs/design.md, "Memory layout"): per layer one tensor
`kv_cache[num_slots, 2, block_size, head_dim]` where slot = page * num_kv_heads + kv_head and
[:, 0] is K, [:, 1] is V. One slot is one contiguous (page, head) item holding K and V of
`block_size` tokens, the same item the host pool stores, so a host -> GPU transfer is one
contiguous copy per item.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 math, the result in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, HF's rotate-half convention; cos and sin broadcast over x's heads."""
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def store_kv_ref(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 write_slots: torch.Tensor, write_offsets: torch.Tensor) -> None:
    """Write new tokens' K/V into their slots.

    k, v: [T, Hkv, D]; write_slots: [T, Hkv] int (slot id, or -1 to skip, e.g. a draft token);
    write_offsets: [T] int, position of the token inside its block.
    """
    T, H, _ = k.shape
    slots = write_slots.long()
    offsets = write_offsets.long()[:, None].expand(T, H)
    keep = slots >= 0
    s, o = slots[keep], offsets[keep]
    kv_cache[s, 0, o] = k[keep].to(kv_cache.dtype)
    kv_cache[s, 1, o] = v[keep].to(kv_cache.dtype)


def paged_decode_ref(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     kv_cache: torch.Tensor, slot_tables: torch.Tensor, cache_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Head-wise paged attention for 1..Q new query tokens per sequence.

    q: [B, Q, Hq, D]; k_new, v_new: [B, Q, Hkv, D] (the new tokens' own K/V, not read from the cache);
    slot_tables: [B, Hkv, max_blocks] int32 slot ids; cache_lens: [B, Hkv] int32 tokens of cache
    each (sequence, kv head) attends, in slot order (block j of the list holds tokens
    j*bs .. j*bs+bs-1; only the last may be partial).
    Query i attends every cached token of its head plus new tokens 0..i (causal among the new).
    Returns [B, Q, Hq, D] in q's dtype; math in float32.
    """
    B, Q, Hq, D = q.shape
    Hkv = k_new.shape[2]
    G = Hq // Hkv
    bs = kv_cache.shape[2]
    out = torch.empty_like(q)
    causal = torch.ones(Q, Q, dtype=torch.bool, device=q.device).tril()
    for b in range(B):
        for h in range(Hkv):
            n = int(cache_lens[b, h])
            nblk = (n + bs - 1) // bs
            slots = slot_tables[b, h, :nblk].long()
            kc = kv_cache[slots, 0].reshape(-1, D)[:n].float()
            vc = kv_cache[slots, 1].reshape(-1, D)[:n].float()
            keys = torch.cat([kc, k_new[b, :, h].float()])  # [n + Q, D]
            vals = torch.cat([vc, v_new[b, :, h].float()])
            qh = q[b, :, h * G:(h + 1) * G].float().transpose(0, 1)  # [G, Q, D]
            scores = (qh @ keys.T) * scale  # [G, Q, n + Q]
            mask = torch.cat([torch.ones(Q, n, dtype=torch.bool, device=q.device), causal], dim=1)
            scores = scores.masked_fill(~mask, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ vals  # [G, Q, D]
            out[b, :, h * G:(h + 1) * G] = o.transpose(0, 1).to(q.dtype)
    return out


def paged_prefill_ref(q: torch.Tensor, kv_cache: torch.Tensor, chunks: torch.Tensor, page_table: torch.Tensor,
                      num_kv_heads: int, scale: float) -> torch.Tensor:
    """Causal attention of prefill chunks over the paged cache, which already holds their own K/V.

    q: [T, Hq, D]; chunks: [N, 4] int (query start, length, prefix_len, page-table row): rows
    [start, start + length) of q are positions [prefix_len, prefix_len + length) of a sequence
    whose pages, in position order, are page_table[row] (head h of a page at slot page * Hkv + h).
    Query i of a chunk attends positions 0 .. prefix_len + i. Returns [T, Hq, D] in q's dtype
    (rows outside every chunk are zero); math in float32.
    """
    T, Hq, D = q.shape
    Hkv = num_kv_heads
    G = Hq // Hkv
    bs = kv_cache.shape[2]
    out = torch.zeros_like(q)
    for start, length, prefix, row in chunks.tolist():
        n = prefix + length
        pages = page_table[row, :(n + bs - 1) // bs].long()
        visible = (torch.arange(n, device=q.device)[None, :]
                   <= prefix + torch.arange(length, device=q.device)[:, None])  # [length, n]
        for h in range(Hkv):
            slots = pages * Hkv + h
            keys = kv_cache[slots, 0].reshape(-1, D)[:n].float()
            vals = kv_cache[slots, 1].reshape(-1, D)[:n].float()
            qh = q[start:start + length, h * G:(h + 1) * G].float().transpose(0, 1)  # [G, length, D]
            scores = (qh @ keys.T * scale).masked_fill(~visible, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ vals  # [G, length, D]
            out[start:start + length, h * G:(h + 1) * G] = o.transpose(0, 1).to(q.dtype)
    return out


def random_paged_prefill(spans, Hkv: int, G: int, D: int, dtype, bs: int = 16, seed: int = 0,
                         device: str = "cpu", spare_pages: int = 3):
    """Random inputs of the prefill kernel: spans are (prefix_len, length) per chunk, one sequence
    each, its pages scattered over the pool. Everything past a sequence's prefix_len + length (the
    rest of its last page, pages no one owns) holds NaN: a kernel that reads it fails a comparison.
    Returns q, the cache, the PrefillTable and each sequence's pages."""
    from oasiskv.kernels.paged_prefill import PrefillTable

    gen = torch.Generator(device=device).manual_seed(seed)
    need = [-(-(p + n) // bs) for p, n in spans]
    num_pages = sum(need) + spare_pages
    order = torch.randperm(num_pages, device=device, generator=gen).tolist()
    kv_cache = torch.full((num_pages * Hkv, 2, bs, D), float("nan"), device=device).to(dtype)
    pages, starts, at = [], [], 0
    for (prefix, length), k in zip(spans, need):
        own, order = order[:k], order[k:]
        pages.append(own)
        starts.append(at)
        at += length
        slots = torch.tensor(own, device=device)[:, None] * Hkv + torch.arange(Hkv, device=device)[None, :]
        flat = kv_cache[slots].permute(1, 2, 0, 3, 4).reshape(Hkv, 2, -1, D)  # [Hkv, 2, k * bs, D]
        flat[:, :, :prefix + length] = torch.randn(Hkv, 2, prefix + length, D, device=device,
                                                   generator=gen).to(dtype)
        kv_cache[slots] = flat.view(Hkv, 2, k, bs, D).permute(2, 0, 1, 3, 4)
    q = torch.randn(at, G * Hkv, D, device=device, generator=gen).to(dtype)
    table = PrefillTable.build(starts, [n for _, n in spans], [p for p, _ in spans], pages, torch.device(device))
    return q, kv_cache, table, pages


def route_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's choice: (weights [T, k] float32, expert ids [T, k]), the top k of the softmax over
    experts, renormalised to sum to 1 if `renormalize` (the HF config's norm_topk_prob)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """A mixture of SwiGLU experts: token t's output is sum_j topk_weights[t, j] * expert
    topk_ids[t, j] of x[t].

    x: [T, H]; w_gate_up: [E, 2I, H] (each expert's gate rows, then its up rows); w_down: [E, H, I];
    topk_weights: [T, k] (float32); topk_ids: [T, k] int. Math in float32; silu(gate) * up and
    each weighted expert output are rounded to x's dtype, the k outputs summed in float32.
    Returns [T, H] in x's dtype.
    """
    T, k = topk_ids.shape
    out = torch.zeros(T, k, x.shape[1], dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        token, choice = (topk_ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[token].float(), w_gate_up[e].float()).chunk(2, dim=-1)
        inter = (F.silu(gate) * up).to(x.dtype)
        y = F.linear(inter.float(), w_down[e].float()) * topk_weights[token, choice, None].float()
        out[token, choice] = y.to(x.dtype).float()
    return out.sum(1).to(x.dtype)
