"""Attention over the paged KV cache: store new K/V, then prefill (SDPA) or decode (paged kernel).

A step's `AttentionMetadata` is built once by the model runner and read by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from oasiskv.kernels.paged_decode import paged_decode


@dataclass
class PrefillChunk:
    """One sequence's slice of a prefill step: tokens [start, start+length) of the step,
    which sit at positions [prefix_len, prefix_len+length) of the sequence."""
    start: int
    length: int
    prefix_len: int
    pages: torch.Tensor  # page ids holding positions [0, prefix_len), on the model's device


@dataclass
class AttentionMetadata:
    write_slots: torch.Tensor  # [T, Hkv] slot each token's K/V goes to, -1 = not stored (draft)
    write_offsets: torch.Tensor  # [T] offset inside the block
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    # decode: T = B * query_len tokens, sequence-major
    # [B, Hkv, max_blocks] shared by every layer, or [L, B, Hkv, max_blocks] when sparse
    # requests (whose heads hold different blocks in every layer) are in the batch
    slot_tables: torch.Tensor | None = None
    cache_lens: torch.Tensor | None = None  # [(L,) B, Hkv] cached tokens attended (new ones excluded)
    query_len: int = 1
    num_splits: int | None = None  # the decode kernel's splits per (sequence, head); None: its choice
    num_stages: int | None = None  # the decode kernel's software-pipeline stages; None: its default
    fused_merge: bool = False  # the decode kernel's last split program merges (no merge launch)
    hooks: object = None  # sparse step hooks: summary_fold, before_ / after_attention, fork_point

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill_chunks)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
           meta: AttentionMetadata, scale: float, layer: int) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] (post-RoPE, already stored in kv_cache by the qkv
    epilogue, with the hooks' `summary_fold`) -> [T, Hq, D]."""
    if meta.hooks is not None:
        meta.hooks.before_attention(layer, q, k, meta)
    if meta.is_prefill:
        out = _prefill(q, k, v, kv_cache, meta.prefill_chunks, scale)
    else:
        T, Hq, D = q.shape
        B, Q = T // meta.query_len, meta.query_len
        tables, lens = meta.slot_tables, meta.cache_lens
        if tables.dim() == 4:
            tables, lens = tables[layer], lens[layer]
        out = paged_decode(q.view(B, Q, Hq, D), k.view(B, Q, -1, D), v.view(B, Q, -1, D),
                           kv_cache, tables, lens, scale, meta.num_splits, meta.num_stages,
                           meta.fused_merge).reshape(T, Hq, D)
    if meta.hooks is not None:
        meta.hooks.after_attention(layer, q, k, meta)
    return out


def _prefill(q, k, v, kv_cache, chunks: list[PrefillChunk], scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    Hkv, bs, D = k.shape[1], kv_cache.shape[2], k.shape[2]
    pages_view = kv_cache.view(-1, Hkv, 2, bs, D)
    for c in chunks:
        qc = q[c.start:c.start + c.length].transpose(0, 1)[None]  # [1, Hq, L, D]
        kc = k[c.start:c.start + c.length].transpose(0, 1)
        vc = v[c.start:c.start + c.length].transpose(0, 1)
        if c.prefix_len == 0:
            o = F.scaled_dot_product_attention(qc, kc[None], vc[None], is_causal=True,
                                               scale=scale, enable_gqa=True)
        else:
            # Chunked prefill: earlier chunks' K/V come back from the paged cache.
            prev = pages_view[c.pages]  # [n, Hkv, 2, bs, D]
            pk = prev[:, :, 0].transpose(0, 1).reshape(Hkv, -1, D)[:, :c.prefix_len]
            pv = prev[:, :, 1].transpose(0, 1).reshape(Hkv, -1, D)[:, :c.prefix_len]
            keys = torch.cat([pk.to(kc.dtype), kc], dim=1)[None]
            vals = torch.cat([pv.to(vc.dtype), vc], dim=1)[None]
            i = torch.arange(c.length, device=q.device)[:, None]
            j = torch.arange(c.prefix_len + c.length, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(qc, keys, vals, attn_mask=j <= c.prefix_len + i,
                                               scale=scale, enable_gqa=True)
        out[c.start:c.start + c.length] = o[0].transpose(0, 1)
    return out
