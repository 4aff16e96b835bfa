"""A long prompt's K/V goes to its host extent while the prompt is still prefilling.

Converting a request to sparse copies its whole K/V to the pinned host pool (a 32K prompt of
Qwen3-8B: 4.8 GB over PCIe, ~0.1 s on the engine loop). For a prompt that converts when its
prefill ends, the blocks each chunk completes are copied right after that chunk's step, on a
stream of their own, while the next chunk computes; the conversion then copies only the
blocks of the last chunk. Complete blocks are never written again while the request is
prefilling, so the copies read its pages as they are.
"""
from __future__ import annotations

import torch


class PrefillHostCopies:
    def __init__(self, kv: torch.Tensor, host, block_size: int, num_kv_heads: int):
        self.kv = kv  # [L, num_slots, 2, bs, D]
        self.host = host  # HostKVPool
        self.block_size = block_size
        self.H = num_kv_heads
        self.stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None
        self.blocks_copied = 0  # over all requests so far (tests and logs)

    @torch.inference_mode()
    def after_prefill_step(self, seqs, num_tokens, converts) -> None:
        """After a prefill step's forward (before the requests' cached counts move on): for each
        request that `converts(seq)` when its prompt is done, the blocks its chunk completed
        that are not its last go to its host extent. A chunk that does not continue where the
        last one ended (a preempted request computing its prompt again) starts the copies over."""
        bs, todo = self.block_size, []
        for seq, n in zip(seqs, num_tokens):
            if seq.host_extent is None or seq.sparse is not None or seq.streamed or not converts(seq):
                continue
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + n
            if start != seq.prefill_copied_to:
                seq.prefill_blocks_on_host = 0
            seq.prefill_copied_to = end
            if end >= seq.num_tokens:
                continue  # the last chunk: the conversion right after this step copies the rest
            first, last = seq.prefill_blocks_on_host, end // bs
            if last > first:
                todo.append((seq, first, last))
                seq.prefill_blocks_on_host = last
        if not todo:
            return
        if self.stream is None:
            self._copy(todo)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.kv.device))  # the chunk's K/V is written
        with torch.cuda.stream(self.stream):  # temporaries belong to this stream: reused in its order
            self._copy(todo)

    def _copy(self, todo) -> None:
        dev = self.kv.device
        heads = torch.arange(self.H, device=dev)
        for seq, first, last in todo:
            items = self.host.extent_items(seq.host_extent)  # [L, max_blocks, H, 2, bs, D]
            pages = torch.tensor(seq.pages[first:last])
            # Through pinned memory: a pageable copy would wait for the chunk's forward.
            pages = pages.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else pages
            slots = (pages[:, None] * self.H + heads[None, :]).flatten()
            for layer in range(self.kv.shape[0]):
                block_kv = self.kv[layer][slots].view(last - first, self.H, *self.kv.shape[2:])
                items[layer, first:last].copy_(block_kv, non_blocking=True)
            self.blocks_copied += last - first

    def taken(self, seq) -> int:
        """At the request's conversion: how many leading blocks are already in its host extent
        (the conversion copies the rest). The caller's stream waits for every copy first, so
        no page is handed on and no extent reused before the copies read and wrote them."""
        if self.stream is not None:
            torch.cuda.current_stream(self.kv.device).wait_stream(self.stream)
        n = seq.prefill_blocks_on_host
        seq.prefill_blocks_on_host = seq.prefill_copied_to = 0
        return n
