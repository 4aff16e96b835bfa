"""Worker side: owns the model and the KV cache, turns a scheduled batch into tensors, runs it.

Decode batches on CUDA replay CUDA graphs captured per bucketed batch size.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np
import torch

from oasiskv.config import EngineConfig
from oasiskv.engine.logprobs import record_prompt_logprobs
from oasiskv.engine.memory_plan import MemoryPlan, allocated
from oasiskv.engine.sampler import on_device, sample_requests, to_host
from oasiskv.engine import runtime_compiles
from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.engine.sequence import Sequence
from oasiskv.engine.sparse_runner import SparseRunner
from oasiskv.kernels import cudnn_prefill, paged_prefill
from oasiskv.layers.attention import AttentionMetadata, PrefillChunk, prefill_table
from oasiskv.models.llama import LlamaForCausalLM
from oasiskv.models.loader import ModelSource, iter_weights, resolve_model, skip_weight_init
from oasiskv.sparse.manager import SparseManager
from oasiskv.sparse.host_pool import HostKVPool, PinnedOnUse
from oasiskv.sparse.pipeline import LookaheadPipeline, PipelineTiming
from oasiskv.sparse.remote_rows import RemoteRows
from oasiskv.sparse.query_recorder import QueryRecorder
from oasiskv.sparse.streamed_prefill import StreamedChunk

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_DEFAULT_KV_GB = 2.0
logger = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.dtype = _DTYPES[cfg.dtype] if cfg.dtype != "auto" else (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.source = self._model_source()
        mc = self.source.config
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        if cfg.max_model_len and cfg.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's "
                             f"max_position_embeddings {mc.max_position_embeddings}")
        self.model_config = mc
        torch.manual_seed(cfg.seed)
        self.model = self._load_model()
        self.block_size = cfg.block_size
        self.num_kv_heads, self.head_dim = mc.num_kv_heads, mc.head_dim
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        self.activation_peak = 0  # the profiled prefill step's, on CUDA (`_cuda_kv_budget`)
        self.num_pages = self._num_pages()
        # One tensor for all layers; layer l's pool is kv[l] = [num_pages * Hkv, 2, block_size, head_dim].
        self.kv = torch.empty(mc.num_layers, self.num_pages * self.num_kv_heads, 2, self.block_size,
                              self.head_dim, dtype=self.dtype, device=self.device)
        self.kv_caches = list(self.kv.unbind(0))
        sc = cfg.sparse
        self.sparse = SparseManager(sc, mc, self.kv, self.block_size) if sc.enabled else None
        self.pipeline = None  # sparse decode's step (docs/design.md), when sparse decode is on
        # A decode instance's arena of received items (`disagg.LocalItems` hands it out).
        self.remote_items = self._remote_items() if self.sparse is not None else None
        if self.sparse is not None:
            self.pipeline = self._build_pipeline(sc, self.kv, self.sparse.host, self.remote_items.tensor
                                                 if self.remote_items is not None else None)
            self.sparse.pipeline = self.pipeline
            if self.device.type == "cuda":  # events inside the captured step: the stall per step
                self.pipeline.timing = PipelineTiming(mc.num_layers)
        # The sparse decode steps, when sparse decode is on.
        self.sparse_runner = None if self.sparse is None else SparseRunner(
            self.model, self.kv_caches, self.sparse, self.pipeline, self._graph_buckets(),
            use_graph=self.device.type == "cuda" and not cfg.enforce_eager,
            attention_splits=cfg.pipeline_tuning.attention_splits)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.memory_plan = MemoryPlan(
            weights=sum(t.nbytes for t in (*self.model.parameters(), *self.model.buffers())),
            activation_peak=self.activation_peak, kv_pool=self.kv.nbytes, page_bytes=self.kv_bytes_per_page,
            pipeline_rows=self.pipeline.state_bytes() if self.pipeline is not None else 0)
        if self.device.type == "cuda" and not cfg.enforce_eager:
            before = allocated(self.device)
            self._capture_decode_graphs()
            if self.pipeline is not None:
                self.sparse_runner.capture_pipeline_steps()
            self.memory_plan.cuda_graphs = allocated(self.device) - before
        if self.sparse is not None:
            self.sparse.scan_blocks = self.max_blocks_per_seq
        if self.device.type == "cuda":
            self.warm_up_prefill(cfg.max_num_batched_tokens)
            if self.sparse is not None:
                self.sparse.warm_up_conversion(self.dtype)
            runtime_compiles.watch()  # from here on, a Triton compilation is logged
        self.memory_plan.allocated = allocated(self.device)
        self.memory_plan.log()

    # ---- set-up -------------------------------------------------------------------------
    def warm_up_prefill(self, chunk: int) -> None:
        """cuDNN's plans for `chunk`-token chunks of long prompts (the scheduler's budget) and the
        Triton prefill kernel, built now rather than on a request's first token."""
        t0 = time.perf_counter()
        n = cudnn_prefill.warm_up(self.kv_caches[0], self.model_config.num_heads, self.num_kv_heads, chunk,
                                  self.max_model_len, self.head_dim ** -0.5)
        if n:
            logger.info("cuDNN prefill plans for %d chunk shapes in %.2f s", n, time.perf_counter() - t0)
        paged_prefill.warm_up(self.kv_caches[0], self.model_config.num_heads, self.num_kv_heads, self.dtype,
                              self.head_dim ** -0.5)

    def _model_source(self) -> ModelSource:
        return resolve_model(self.cfg.model, self.cfg.load_format, self.cfg.rope_scaling)

    def _load_model(self) -> LlamaForCausalLM:
        mc = self.source.config
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), skip_weight_init():
                model = LlamaForCausalLM(mc)
        finally:
            torch.set_default_dtype(default_dtype)
        model.load_weights(iter_weights(self.source, self.dtype, device=self.device))
        return model.eval().requires_grad_(False)

    def _build_pipeline(self, sc, kv: torch.Tensor, host: HostKVPool, remote_items: torch.Tensor | None,
                        ) -> LookaheadPipeline:
        """The batched pipeline over the pool `kv`, with rows for --max-num-seqs requests; on a
        decode instance every row may be a disaggregated one (`remote_items`: its arena)."""
        cfg, mc = self.cfg, self.model_config
        remote = None
        if remote_items is not None:
            remote = RemoteRows(remote_items, cfg.max_num_seqs, mc.num_layers, self.max_blocks_per_seq,
                                self.num_kv_heads, cfg.max_num_seqs, sc.top_k_blocks, kv.device,
                                want_per_head=cfg.want_per_head())
        return LookaheadPipeline(sc, mc, kv, host, max_rows=cfg.max_num_seqs, max_blocks=self.max_blocks_per_seq,
                                 block_size=self.block_size, tuning=cfg.pipeline_tuning, remote=remote)

    def _pipeline_reserve(self) -> int:
        """GPU bytes of the pipeline's per-row state (its tables, hand-off buffers, and on a
        decode instance the item maps of its disaggregated rows: set --max-num-seqs to what it
        decodes at once), which the KV budget holds besides the pages: measured on a pipeline
        built over a one-page pool (the state does not depend on the pool's size)."""
        if not self.cfg.sparse.enabled:
            return 0
        sc = dataclasses.replace(self.cfg.sparse, fetch_budget="off")  # no link measurement
        kv = torch.empty(self.model_config.num_layers, self.num_kv_heads, *self.kv_page_shape,
                         dtype=self.dtype, device=self.device)
        host = HostKVPool(0, self.block_size, self.head_dim, self.dtype, pin=self.device.type == "cuda", num_items=1)
        remote_items = PinnedOnUse((1, *self.kv_page_shape), self.dtype, pin=self.device.type == "cuda").tensor \
            if self.cfg.remote_kv_gb is not None else None
        return self._build_pipeline(sc, kv, host, remote_items).state_bytes()

    def _remote_items(self) -> PinnedOnUse | None:
        """[N, 2, bs, D] of `remote_kv_gb` GiB, on CUDA pinned and mapped as it fills (the
        pipeline's transfer reads it through UVA), or None when this is not a decode instance."""
        gb = self.cfg.remote_kv_gb
        if gb is None:
            return None
        shape = (int(gb * 2**30) // self.sparse.item_bytes, 2, self.block_size, self.head_dim)
        return PinnedOnUse(shape, self.dtype, pin=self.device.type == "cuda")

    @property
    def kv_page_shape(self) -> tuple[int, int, int]:
        """One (page, head) slot: [2, block_size, head_dim]."""
        return (2, self.block_size, self.head_dim)

    @property
    def kv_bytes_per_page(self) -> int:
        return self.model_config.kv_bytes_per_token(self.dtype.itemsize) * self.block_size

    def _num_pages(self) -> int:
        """Pages of the pool: the KV budget (--kv-cache-gb, else what the card leaves) less the
        pipeline's per-row state, so the budget holds every byte of KV state: dense pages,
        working sets and summaries (pages too: `summary_arena`), the pipeline's rows."""
        if self.cfg.kv_cache_gb is not None:
            budget = self.cfg.kv_cache_gb * 2**30
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = CPU_DEFAULT_KV_GB * 2**30
        rows = self._pipeline_reserve()
        if budget - rows < self.kv_bytes_per_page:
            raise ValueError(f"the KV budget ({budget / 2**30:.2f} GiB) holds the "
                             f"sparse pipeline's rows ({rows / 2**30:.2f} GiB for "
                             f"--max-num-seqs {self.cfg.max_num_seqs} of --max-model-len {self.max_model_len}) and "
                             "no page: raise --kv-cache-gb or lower --max-num-seqs or --max-model-len")
        budget -= rows
        # Never more than every sequence at full length needs.
        cap = self.cfg.max_num_seqs * self.max_blocks_per_seq
        return max(0, min(int(budget // self.kv_bytes_per_page), cap))

    def _cuda_kv_budget(self) -> float:
        """Like vLLM: total * utilization - weights - the activation peak of a full prefill step."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        n = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        # One chunk of n tokens from position 0, its K/V in pages 0.. of one pool that every layer
        # shares (the prefill kernel reads them back; n tokens of KV, not a layer's worth each).
        pages = list(range(math.ceil(n / self.block_size)))
        pool = torch.zeros(len(pages) * self.num_kv_heads, 2, self.block_size, self.head_dim,
                           dtype=self.dtype, device=self.device)
        positions = np.arange(n, dtype=np.int64)
        slots, offsets = self._write_locations(np.array(pages)[positions // self.block_size], positions)
        chunks = [PrefillChunk(0, n, 0, pages)]
        meta = AttentionMetadata(write_slots=slots, write_offsets=offsets, prefill_chunks=chunks,
                                 prefill_table=prefill_table(chunks, self.device))
        dummy_kv = [pool] * self.model_config.num_layers
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(n, device=self.device), dummy_kv, meta)
        self.model.compute_logits(hidden[-self.cfg.max_num_seqs:])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self.activation_peak = peak - base
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        return total * self.cfg.gpu_memory_utilization - peak - used_by_others - 2**30

    # ---- batch preparation ------------------------------------------------------------
    def _write_locations(self, pages: np.ndarray, positions: np.ndarray):
        """For each token, given the page holding it: the slot of every KV head its K/V goes to,
        and the offset in the block."""
        slots = pages[:, None] * self.num_kv_heads + np.arange(self.num_kv_heads)[None, :]
        return (self._h2d(slots.astype(np.int32)), self._h2d((positions % self.block_size).astype(np.int32)))

    def _h2d(self, x: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Host array -> device without waiting for the device (pinned staging, async copy): a
        pageable copy would wait for the step in flight and undo async scheduling."""
        t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def prepare_prefill(self, batch: ScheduledBatch):
        """-> input ids, positions, attention metadata, the rows whose logits sample a token (a
        finished prompt's last), and (seq, first row, first position, rows) of each chunk whose
        request asks for prompt logprobs (every row of it needs logits)."""
        ids, pos, pages, chunks, logits_rows, prompt_rows = [], [], [], [], [], []
        start = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            c0 = seq.num_cached_tokens
            ids.append(np.array(seq.token_slice(c0, c0 + n), dtype=np.int64))
            pos.append(np.arange(c0, c0 + n, dtype=np.int64))
            used_pages = (c0 + n + self.block_size - 1) // self.block_size
            if seq.streamed:  # its staging pages: `run_streamed_prefill` sets the tables
                pages.append(np.zeros(n, dtype=np.int64))
                chunks.append(PrefillChunk(start, n, c0, []))
            else:
                pages.append(seq.page_array()[pos[-1] // self.block_size])
                chunks.append(PrefillChunk(start, n, c0, seq.pages[:used_pages]))
            if seq.params.prompt_logprobs is not None and c0 < len(seq.prompt_token_ids) - 1:
                prompt_rows.append((seq, start, c0, n))
            start += n
            if c0 + n == seq.num_tokens:
                logits_rows.append(start - 1)
        positions = np.concatenate(pos)
        slots, offsets = self._write_locations(np.concatenate(pages), positions)
        meta = AttentionMetadata(write_slots=slots, write_offsets=offsets, prefill_chunks=chunks,
                                 prefill_table=prefill_table(chunks, self.device))
        if self.sparse is not None:
            record = {}
            for seq, n, c in zip(batch.seqs, batch.num_tokens, chunks):
                if seq.num_cached_tokens + n == seq.num_tokens and self.sparse.should_convert(seq, seq.num_tokens):
                    record[c.start + n - 1] = self.sparse_runner.record_query(seq)
            if record:
                meta.hooks = QueryRecorder(record)
        return self._h2d(np.concatenate(ids)), self._h2d(positions), meta, logits_rows, prompt_rows

    def run_streamed_prefill(self, seq: Sequence, ids: torch.Tensor, positions: torch.Tensor,
                             meta: AttentionMetadata) -> torch.Tensor:
        """One chunk of a prompt longer than the pool, its prefix streamed from the host a layer
        at a time (`sparse.streamed_prefill`); `meta` from `prepare_prefill` keeps its hooks."""
        c0, n = seq.num_cached_tokens, ids.shape[0]
        if self.device.type == "cuda" and getattr(self, "streamed_copies", None) is None:
            self.streamed_copies = torch.cuda.Stream(self.device)  # one copy stream for every streamed chunk
        chunk = StreamedChunk(self.kv, self.sparse.host, seq, c0, n, self.block_size, self.num_kv_heads,
                              getattr(self, "streamed_copies", None))
        pos = np.arange(c0, c0 + n, dtype=np.int64)
        chunks = [PrefillChunk(0, n, c0, chunk.pages(buffer)) for buffer in range(chunk.buffers)]
        tables = [prefill_table([c], self.device) for c in chunks]
        writes = [self._write_locations(np.array(c.pages, dtype=np.int64)[pos // self.block_size], pos) for c in chunks]

        def set_buffer(b: int) -> None:
            meta.prefill_table = tables[b]
            meta.write_slots, meta.write_offsets = writes[b]
        meta.prefill_chunks = chunks[:1]
        hidden = self.model(ids, positions, chunk.layers(set_buffer), meta)
        chunk.finish()
        return hidden

    def prepare_decode(self, seqs: list[Sequence], ids: torch.Tensor | None = None):
        """ids: the input tokens already on the device (async scheduling: the last step's
        samples, not yet read by the host); default: each sequence's newest token."""
        B, Hkv = len(seqs), self.num_kv_heads
        positions = np.array([s.num_tokens - 1 for s in seqs], dtype=np.int64)
        pages = np.array([s.pages[p // self.block_size] for s, p in zip(seqs, positions)], dtype=np.int64)
        slots, offsets = self._write_locations(pages, positions)
        arrays = [s.page_array() for s in seqs]
        nblk = max(len(a) for a in arrays)
        page_table = np.zeros((B, nblk), dtype=np.int64)
        for i, a in enumerate(arrays):
            page_table[i, :len(a)] = a
        pt = self._h2d(page_table)
        # Dense request: head h of block j lives at slot page_table[j] * Hkv + h (docs/design.md, memory layout).
        slot_tables = (pt[:, None, :] * Hkv + torch.arange(Hkv, device=self.device)[None, :, None]).int()
        pos = self._h2d(positions)
        cache_lens = pos.int()[:, None].expand(B, Hkv).contiguous()
        meta = AttentionMetadata(write_slots=slots, write_offsets=offsets, slot_tables=slot_tables,
                                 cache_lens=cache_lens, query_len=1)
        if self.sparse is not None:  # requests that convert after this step record their query
            record = {b: self.sparse_runner.record_query(s) for b, s in enumerate(seqs)
                      if self.sparse.should_convert(s, s.num_tokens)}
            meta.hooks = QueryRecorder(record) if record else None
        if ids is None:
            ids = on_device([s.last_token_id for s in seqs], self.device)
        return ids, pos, meta

    # ---- execution ----------------------------------------------------------------------
    def convert_to_sparse(self, seq: Sequence, last_q: torch.Tensor, pages: list[int], summary_run: list[int]) -> None:
        """A dense request moves to sparse decode after a step (`SparseManager.convert`)."""
        self.sparse.convert(seq, last_q, pages, summary_run)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Runs one step; returns the sampled token per sequence (None: mid-prompt chunk)."""
        if batch.is_prefill:
            if self.sparse is not None and self.sparse.host_cache is not None:
                self.sparse.load_host_hits(batch.seqs)  # host-tier hits into their pages first
            ids, positions, meta, rows, prompt_rows = self.prepare_prefill(batch)
            if batch.seqs[0].streamed:  # alone in its step (the scheduler's rule)
                hidden = self.run_streamed_prefill(batch.seqs[0], ids, positions, meta)
            else:
                hidden = self.model(ids, positions, self.kv_caches, meta)
            if self.sparse is not None:
                self.sparse.after_prefill_step(batch.seqs, batch.num_tokens)
            for seq, first, pos, n in prompt_rows:
                record_prompt_logprobs(seq, hidden[first:first + n], pos, self.model.compute_logits)
            hidden = hidden[rows]
            sampling_seqs = [s for s, n in zip(batch.seqs, batch.num_tokens)
                             if s.num_cached_tokens + n == s.num_tokens]
        elif self.pipeline is not None and any(s.sparse is not None for s in batch.seqs):
            return self.run_with_pipeline(batch.seqs)
        else:
            hidden = self.run_decode(batch.seqs)
            sampling_seqs = batch.seqs
        tokens = []
        if sampling_seqs:
            tokens = sample_requests(self.model.compute_logits(hidden), sampling_seqs).tolist()
        by_seq = {id(s): t for s, t in zip(sampling_seqs, tokens)}
        return [by_seq.get(id(s)) for s in batch.seqs]

    @torch.inference_mode()
    def launch_decode(self, seqs: list[Sequence], ids: torch.Tensor | None = None):
        """A dense decode step that does not wait for the device. Returns the sampled tokens on
        the device (the next step's inputs), a pinned host copy of them, and the event that marks
        the copy done. Async scheduling reads the host copy once the event fires: `.tolist()` on
        the device tensor would queue behind the step launched after this one and wait for it too.
        A batch of pipeline rows launches `SparseRunner.launch_pipeline_decode` instead: ids and
        tokens are then [n, 2] (token, draft) pairs, and `read_pipeline_decode` reads them."""
        if self.is_pipeline_batch(seqs):
            return self.sparse_runner.launch_pipeline_decode(seqs, ids)
        return self.sample_launched(self.launch_logits(seqs, ids), seqs)

    @torch.inference_mode()
    def launch_logits(self, seqs: list[Sequence], ids: torch.Tensor | None = None) -> torch.Tensor:
        """A dense decode step's logits, launched and not waited for; `sample_launched` samples
        them later (a grammar's mask needs the step before read first)."""
        return self.model.compute_logits(self.run_decode(seqs, ids))

    @torch.inference_mode()
    def sample_launched(self, logits: torch.Tensor, seqs: list[Sequence]):
        """`launch_decode`'s sampling half: the tokens on the device, their pinned host copy, its event."""
        tokens = sample_requests(logits, seqs)
        return tokens, *to_host(tokens)

    def run_with_pipeline(self, seqs: list[Sequence]) -> list[int]:
        """Sparse requests step through the pipeline; dense ones (if any) through the dense path."""
        sparse = [s for s in seqs if s.sparse is not None]
        dense = [s for s in seqs if s.sparse is None]
        tokens = {}
        if dense:
            got = sample_requests(self.model.compute_logits(self.run_decode(dense)), dense).tolist()
            tokens.update(zip(map(id, dense), got))
        tokens.update(zip(map(id, sparse), self.sparse_runner.run_pipeline_decode(sparse)))
        return [tokens[id(s)] for s in seqs]

    def take_conversions(self) -> list[tuple[Sequence, torch.Tensor]]:
        """The requests the last step decided to convert, with their recorded queries (then none)."""
        return [] if self.sparse_runner is None else self.sparse_runner.take_conversions()

    def is_pipeline_batch(self, seqs: list[Sequence]) -> bool:
        """Every request of the batch decodes sparse through the lookahead pipeline."""
        return self.pipeline is not None and bool(seqs) and all(s.sparse is not None for s in seqs)

    def run_decode(self, seqs: list[Sequence], ids: torch.Tensor | None = None) -> torch.Tensor:
        ids, positions, meta = self.prepare_decode(seqs, ids)
        B = len(seqs)
        bucket = next((b for b in sorted(self.graphs) if b >= B), None)
        if bucket is None or meta.hooks is not None:  # (a step that records queries runs eager)
            return self.model(ids, positions, self.kv_caches, meta)
        s = self.static
        s["ids"][:B].copy_(ids)
        s["positions"][:B].copy_(positions)
        s["write_slots"][:B].copy_(meta.write_slots)
        s["write_slots"][B:bucket].fill_(-1)  # padding rows write nothing
        s["write_offsets"][:B].copy_(meta.write_offsets)
        nblk = meta.slot_tables.shape[2]
        s["slot_tables"][:B, :, :nblk].copy_(meta.slot_tables)
        s["cache_lens"][:B].copy_(meta.cache_lens)
        s["cache_lens"][B:bucket].zero_()
        self.graphs[bucket].replay()
        return s["hidden"][:B]

    def _graph_buckets(self) -> list[int]:
        top = min(self.cfg.max_num_seqs, self.cfg.max_cuda_graph_batch)
        buckets = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 16))
        return sorted(set(buckets + [top]))

    def _capture_decode_graphs(self) -> None:
        dev, Hkv, maxB = self.device, self.num_kv_heads, max(self._graph_buckets())
        s = self.static = {
            "ids": torch.zeros(maxB, dtype=torch.long, device=dev),
            "positions": torch.zeros(maxB, dtype=torch.long, device=dev),
            "write_slots": torch.full((maxB, Hkv), -1, dtype=torch.int32, device=dev),
            "write_offsets": torch.zeros(maxB, dtype=torch.int32, device=dev),
            "slot_tables": torch.zeros(maxB, Hkv, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
            "cache_lens": torch.zeros(maxB, Hkv, dtype=torch.int32, device=dev),
        }
        s["hidden"] = torch.zeros(maxB, self.model_config.hidden_size, dtype=self.dtype, device=dev)
        pool = None
        for B in sorted(self._graph_buckets(), reverse=True):
            meta = AttentionMetadata(write_slots=s["write_slots"][:B], write_offsets=s["write_offsets"][:B],
                                     slot_tables=s["slot_tables"][:B], cache_lens=s["cache_lens"][:B])
            run = lambda: s["hidden"][:B].copy_(
                self.model(s["ids"][:B], s["positions"][:B], self.kv_caches, meta))
            run()  # warm-up compiles the Triton kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                run()
            pool = graph.pool()
            self.graphs[B] = graph
        torch.cuda.synchronize()
