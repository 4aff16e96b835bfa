"""Attention over the paged KV cache: store new K/V, then the paged prefill or decode kernel.

A step's `AttentionMetadata` is built once by the model runner and read by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from oasiskv.kernels.paged_decode import paged_decode
from oasiskv.kernels.paged_prefill import PrefillTable, paged_prefill
from oasiskv.kernels.qkv_epilogue import SummaryFold


@dataclass
class PrefillChunk:
    """One sequence's slice of a prefill step: tokens [start, start+length) of the step,
    which sit at positions [prefix_len, prefix_len+length) of the sequence."""
    start: int
    length: int
    prefix_len: int
    pages: list[int]  # page ids holding positions [0, prefix_len + length), the chunk's own included


def prefill_table(chunks: list[PrefillChunk], device: torch.device) -> PrefillTable:
    """The step's chunks as the prefill kernel reads them (one copy to the device per step)."""
    return PrefillTable.build([c.start for c in chunks], [c.length for c in chunks],
                              [c.prefix_len for c in chunks], [c.pages for c in chunks], device)


@runtime_checkable
class AttentionHooks(Protocol):
    """The interface between the model's layers and the sparse machinery: what a sparse decode
    step does inside each layer (`sparse.pipeline.LookaheadPipeline`), or a dense step whose
    requests convert after it (`sparse.query_recorder.QueryRecorder`)."""

    def summary_fold(self, layer: int) -> SummaryFold | None:
        """The qkv epilogue's fold of the step's keys into the block summaries, if it does one."""

    def before_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata) -> None:
        """q [T, Hq, D], k [T, Hkv, D] of the step, before the attention kernel reads meta."""

    def after_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata) -> None:
        """The same, once the attention kernel is launched."""

    def fork_point(self, layer: int, part: str) -> None:
        """The model launched `part` of the layer ("o_proj", "mlp"): where side work may start."""


@dataclass
class AttentionMetadata:
    write_slots: torch.Tensor  # [T, Hkv] slot each token's K/V goes to, -1 = not stored (draft)
    write_offsets: torch.Tensor  # [T] offset inside the block
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    prefill_table: PrefillTable | None = None  # the same chunks on the device: `prefill_table(chunks)`
    # decode: T = B * query_len tokens, sequence-major
    # [B, Hkv, max_blocks] shared by every layer, or [L, B, Hkv, max_blocks] when sparse
    # requests (whose heads hold different blocks in every layer) are in the batch
    slot_tables: torch.Tensor | None = None
    cache_lens: torch.Tensor | None = None  # [(L,) B, Hkv] cached tokens attended (new ones excluded)
    query_len: int = 1
    num_splits: int | None = None  # the decode kernel's splits per (sequence, head); None: its choice
    num_stages: int | None = None  # the decode kernel's software-pipeline stages; None: its default
    hooks: AttentionHooks | None = None  # a sparse step's work around attention

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill_chunks)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
           meta: AttentionMetadata, scale: float, layer: int) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] (post-RoPE, already stored in kv_cache by the qkv
    epilogue, with the hooks' `summary_fold`) -> [T, Hq, D]. A prefill reads every key and value
    from the cache, but for cuDNN's chunks, which take their own from k and v."""
    if meta.hooks is not None:
        meta.hooks.before_attention(layer, q, k, meta)
    if meta.is_prefill:
        out = paged_prefill(q, kv_cache, meta.prefill_table, k.shape[1], scale, k, v)
    else:
        T, Hq, D = q.shape
        B, Q = T // meta.query_len, meta.query_len
        tables, lens = meta.slot_tables, meta.cache_lens
        if tables.dim() == 4:
            tables, lens = tables[layer], lens[layer]
        out = paged_decode(q.view(B, Q, Hq, D), k.view(B, Q, -1, D), v.view(B, Q, -1, D),
                           kv_cache, tables, lens, scale, meta.num_splits, meta.num_stages).reshape(T, Hq, D)
    if meta.hooks is not None:
        meta.hooks.after_attention(layer, q, k, meta)
    return out

