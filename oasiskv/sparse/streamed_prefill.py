"""Prefill beyond HBM: a prompt longer than the GPU page pool is prefilled chunk by chunk with its
K/V in the host pool only (the request is sparse from its first chunk; docs/design.md, "Prefill
beyond HBM").

Each chunk attends to its whole prefix exactly. Layer l's prefix K/V is streamed from the host
extent into a staging buffer on the GPU while layer l-1 computes; the layer's qkv epilogue writes
the chunk's own K/V behind it there, the attention reads both, and the chunk's blocks of layer l
are then written through to the host. Two buffers alternate between layers (double buffering).

The buffers are pages of the pool: the request holds a run of m consecutive pages, and the pool
seen as one tensor `[L * pages * Hkv, 2, bs, D]` gives each of the m pages one slot range per
layer region. Buffer 0 is regions [0, L // 2), buffer 1 regions [L // 2, 2 * (L // 2)), so
m = ceil(blocks / (L // 2)) pages stage a prompt of `blocks` blocks (a 36K prompt of a 64-layer
model: 72 pages). Staged block b of a buffer sits in region base + b // m, page run[b % m]: the
attention and the epilogue address it as the "page" region * pages + page of that view.
On CUDA the copies run on a stream of their own, each layer waiting on its staging's event.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch


def staging_regions(num_layers: int) -> int:
    """Layer regions per buffer (one buffer, no overlap, for a one-layer model)."""
    return max(1, num_layers // 2)


def staging_pages(num_layers: int, num_blocks: int) -> int:
    """Pages a request of `num_blocks` blocks holds to stage any of its chunks."""
    return -(-num_blocks // staging_regions(num_layers))


class StreamedChunk:
    """One streamed chunk's step: tokens [prefix, prefix + length) of `seq`, whose first
    prefix // block_size blocks are in its host extent (prefix is a multiple of block_size)."""

    def __init__(self, kv: torch.Tensor, host, seq, prefix: int, length: int, block_size: int, num_kv_heads: int,
                 stream: torch.cuda.Stream | None = None):
        """stream: the copies' (on CUDA; the caller keeps one for every chunk)."""
        self.kv, self.host, self.seq, self.bs, self.H = kv, host, seq, block_size, num_kv_heads
        assert prefix % block_size == 0
        self.L, self.num_pages = kv.shape[0], kv.shape[1] // num_kv_heads
        self.flat = kv.view(-1, *kv.shape[2:])  # the pool as one tensor of slots: the layers' views
        self.run = seq.pages  # the staging run
        self.prefix_blocks = prefix // block_size
        self.blocks = -(-(prefix + length) // block_size)  # prefix and chunk, the last maybe partial
        self.regions = staging_regions(self.L)
        self.buffers = 2 if self.L > 1 else 1
        assert len(self.run) * self.regions >= self.blocks, "the staging run is too short"
        self.items = host.extent_items(seq.host_extent)  # [L, max_blocks, H, 2, bs, D]
        self.stream = stream
        self.staged: list[torch.cuda.Event | None] = [None] * self.L

    def pages(self, buffer: int) -> list[int]:
        """The view's page of each staged block [0, blocks) in `buffer`."""
        m, base = len(self.run), buffer * self.regions
        return [(base + b // m) * self.num_pages + self.run[b % m] for b in range(self.blocks)]

    def _segments(self, layer: int, first: int, last: int):
        """(blocks [b0, b1), the pool's slice holding them) for blocks [first, last) of the
        buffer that layer `layer` uses: one slice per region they cross."""
        m, base = len(self.run), (layer % self.buffers) * self.regions
        b = first
        while b < last:
            region, at = base + b // m, b % m
            n = min(last - b, m - at)
            p0 = self.run[0] + at  # the run is consecutive
            yield b, b + n, self.kv[region, p0 * self.H:(p0 + n) * self.H]
            b += n

    def _stage(self, layer: int) -> None:
        """Layer `layer`'s prefix, host -> its buffer."""
        src = self.items[layer]
        for b0, b1, dst in self._segments(layer, 0, self.prefix_blocks):
            dst.copy_(src[b0:b1].flatten(0, 1), non_blocking=True)

    def _write_back(self, layer: int) -> None:
        """The chunk's blocks of layer `layer`, its buffer -> host."""
        dst = self.items[layer]
        for b0, b1, src in self._segments(layer, self.prefix_blocks, self.blocks):
            dst[b0:b1].copy_(src.view(b1 - b0, self.H, *src.shape[1:]), non_blocking=True)

    def _on_copy_stream(self, work, after: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        if self.stream is None:
            work()
            return None
        if after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            work()
            done = torch.cuda.Event()
            done.record()
        return done

    def layers(self, set_buffer) -> Iterator[torch.Tensor]:
        """The KV cache each layer of the forward reads: the pool's single view, with layer l's
        prefix staged in buffer l % 2 (`set_buffer(b)` points the step's tables at that buffer
        before the layer runs). Call `finish` after the forward."""
        for layer in range(self.buffers):
            self.staged[layer] = self._on_copy_stream(lambda lay=layer: self._stage(lay))
        for layer in range(self.L):
            if self.staged[layer] is not None:
                torch.cuda.current_stream(self.kv.device).wait_event(self.staged[layer])
            set_buffer(layer % self.buffers)
            yield self.flat
            self._after_layer(layer)
        # The last layer's write-back: `finish`, since the forward stops asking after it.

    def _after_layer(self, layer: int) -> None:
        """Layer `layer` ran (enqueued): its chunk goes to the host, then its buffer takes
        layer + 2's prefix (the same stream, in order: the write-back reads first)."""
        done = None
        if self.stream is not None:
            done = torch.cuda.Event()
            done.record()

        def work() -> None:
            self._write_back(layer)
            if self.buffers == 2 and layer + 2 < self.L:
                self._stage(layer + 2)
        event = self._on_copy_stream(work, after=done)
        if self.buffers == 2 and layer + 2 < self.L:
            self.staged[layer + 2] = event

    def finish(self) -> None:
        """After the forward: the last layer's chunk to the host, and the host waits for every
        copy (the pages may be handed on, and the host items read on the CPU, after this)."""
        self._after_layer(self.L - 1)
        if self.stream is not None:
            self.stream.synchronize()
