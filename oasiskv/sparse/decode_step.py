"""One decode step of a batch of sparse requests: two query rows per request (the token and
its lookahead draft), the foreground tables built on the device from the pipeline's state,
the per-layer pipeline launched from inside the layers, and the join at the end. On CUDA the
whole step (foreground and the three pipeline streams) is one CUDA graph; the host only
writes the input token ids before each replay.
"""
from __future__ import annotations

import contextlib

import torch

from oasiskv.layers.attention import AttentionMetadata
from oasiskv.sparse.pipeline import LookaheadPipeline


class SparseDecodeStep:
    def __init__(self, model, kv_caches: list[torch.Tensor], pipeline: LookaheadPipeline,
                 max_position: int, use_graph: bool, rows: int | None = None, scan_blocks: int | None = None):
        """rows: the step runs over the pipeline's first `rows` rows (a batch-size bucket);
        scan_blocks: the prediction's width (`LookaheadPipeline.scan_widths`; None: the pipeline's)."""
        p = self.pipeline = pipeline
        self.rows = rows or p.R
        self.scan_blocks = scan_blocks
        self.model, self.kv_caches, self.max_position = model, kv_caches, max_position
        self.ids = torch.zeros(self.rows * 2, dtype=torch.long, device=p.device)
        self.graph = None
        if use_graph:
            self._capture()

    @torch.inference_mode()
    def _forward(self) -> torch.Tensor:
        p, R = self.pipeline, self.rows
        p.B = R
        if self.scan_blocks is not None:
            p.set_scan(self.scan_blocks)
        if p.timing is not None:
            p.timing.start.record()
        p.start_clock()
        p.step += 1
        t = p.step_tables(self.max_position)  # before begin_step: it keeps the last step's write-through
        p.begin_step()
        meta = AttentionMetadata(write_slots=t.write_slots, write_offsets=t.write_offsets, slot_tables=t.slot_tables,
                                 cache_lens=t.cache_lens, query_len=2, num_splits=p.tuning.attention_splits,
                                 num_stages=p.attention_stages, hooks=p)
        hidden = self.model(self.ids, t.positions, self.kv_caches, meta)
        p.join()
        p.cached[:R] += p.active[:R].int()  # the token is in the cache now
        return hidden

    @torch.inference_mode()
    def first_pass(self, ids: torch.Tensor) -> torch.Tensor:
        """The step's model run eager with the stages off (`Drafter.first_pass`: the oracle finds
        the true next tokens with it): ids [rows*2] -> hidden states [rows*2, hidden]. It stores
        the token's K/V and folds its key, as the step run after it does again (both
        idempotent), and leaves the step count, the cached tokens and every transfer to that
        step; the last step's deferred work lands first, so that step's tables keep their
        write-through."""
        p = self.pipeline
        p.flush_deferred()
        p.B = self.rows
        self.ids.copy_(ids)
        prefetch, p.prefetch = p.prefetch, False
        try:
            t = p.step_tables(self.max_position)
            meta = AttentionMetadata(write_slots=t.write_slots, write_offsets=t.write_offsets,
                                     slot_tables=t.slot_tables, cache_lens=t.cache_lens, query_len=2,
                                     num_splits=p.tuning.attention_splits, num_stages=p.attention_stages, hooks=p)
            with self._gemms():
                return self.model(self.ids, t.positions, self.kv_caches, meta)
        finally:
            p.prefetch = prefetch

    def _capture(self) -> None:
        p = self.pipeline
        # Warm-up (compiles the kernels outside the capture) with every row inactive, so it
        # writes no KV, predicts nothing and moves nothing: the state stays as the caller set it.
        active, step = p.active.clone(), p.step.clone()
        p.active.fill_(False)  # (rows in use by running requests are untouched too)
        with self._gemms():
            self._forward()
            torch.cuda.synchronize()
            p.active.copy_(active)
            p.step.copy_(step)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.hidden = self._forward()
        torch.cuda.synchronize()

    def _gemms(self):
        """The GEMM settings the step runs (and is captured) under: SMs left to the stages
        when they run beside it."""
        p = self.pipeline
        return foreground_gemms(p.tuning.gemm_sm_carveout if p.background else None)

    @torch.inference_mode()
    def run(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [rows*2] (token, draft) per row -> hidden states [rows*2, hidden]."""
        self.ids.copy_(ids, non_blocking=True)
        if self.graph is None:
            with self._gemms():
                return self._forward()
        self.graph.replay()
        return self.hidden


@contextlib.contextmanager
def foreground_gemms(carveout: int | None):
    """The step's GEMMs through cuBLASLt leaving `carveout` SMs free for the pipeline's stages
    (`PipelineTuning.gemm_sm_carveout`); torch's settings come back after. None: leave them alone."""
    if carveout is None or not torch.cuda.is_available():
        yield
        return
    library, before = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(carveout or None)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)
        torch.backends.cuda.preferred_blas_library(library)
