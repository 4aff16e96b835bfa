"""The sparse requests' state outside the decode step (docs/design.md): admission (host
extents reserved and released), the prefix cache's host tier, and conversion (dense -> sparse:
full KV to the host pool, summaries, the first working set), after which the request takes a
row of the lookahead pipeline (`oasiskv/sparse/pipeline.py`), which runs every decode step.
"""
from __future__ import annotations

import math
import torch

from oasiskv.sparse.block_scores import score_topk
from oasiskv.sparse.config import MIN_CONTEXT_PER_WORKING_SET, PRESSURE_CONTEXT_PER_WORKING_SET, SparseConfig
from oasiskv.sparse.drafters import TokenHistory, drafter_named, next_draft
from oasiskv.sparse.host_cache import HostHit, HostPrefixCache
from oasiskv.sparse.host_pool import HostKVPool
from oasiskv.sparse.prefill_copies import PrefillHostCopies
from oasiskv.sparse.summaries import summary_dtype, write_block_minmax
from oasiskv.sparse.streamed_prefill import staging_pages
from oasiskv.sparse.summary_arena import SummaryArena
from oasiskv.sparse.working_set import WorkingSet


STEP_TOTALS = ("steps", "foreground_s", "stall_s", "bytes", "budget_bytes", "hits", "predicted")


class SparseManager:
    def __init__(self, cfg: SparseConfig, model_config, kv: torch.Tensor, block_size: int):
        self.cfg = cfg
        self.drafter = drafter_named(cfg.drafter)
        self.mc = model_config
        self.kv = kv  # [L, num_slots, 2, bs, D]
        self.block_size = block_size
        self.L, self.Hkv, self.D = model_config.num_layers, model_config.num_kv_heads, model_config.head_dim
        self.G = model_config.group_size
        self.device, self.dtype = kv.device, kv.dtype
        self.summary_dtype = summary_dtype(cfg.summary_dtype, kv.dtype, kv.device)
        self.arena = SummaryArena(kv, self.Hkv, self.summary_dtype)  # summaries in the page pool
        self.host = HostKVPool(cfg.host_kv_gb, block_size, self.D, self.dtype,
                               pin=kv.is_cuda)
        self.item_bytes = 2 * block_size * self.D * self.dtype.itemsize
        self.prefill_copies = PrefillHostCopies(kv, self.host, block_size, self.Hkv)
        self.step = 0  # what a conversion's LRU stamps count from (its pipeline row restamps them)
        self.pipeline = None  # LookaheadPipeline, when the engine decodes sparse through it
        # On a decode instance (oasiskv.disagg.decode_side.RemoteSource): where the blocks of
        # working sets with `remote` set live; it reads them around the pipeline's steps.
        self.remote = None
        # Every sparse decode step's figures, summed (served as counters on /metrics): steps,
        # foreground and stall seconds, bytes moved, the budget's bytes, hits and
        # predicted items.
        self.totals = dict.fromkeys(STEP_TOTALS, 0)
        self.num_conversions = 0
        # The conversion's prediction scans this many blocks of every request (at least its
        # own): one width for all, so its kernels compile once, at start-up (`warm_up_conversion`).
        self.scan_blocks = 0
        self.host_cache: HostPrefixCache | None = None  # the prefix cache's host tier, once enabled

    def enable_host_tier(self) -> HostPrefixCache:
        """Finished requests' extents stay as the prefix cache's host tier (docs/prefix_caching.md)."""
        if self.host_cache is None:
            self.host_cache = HostPrefixCache(self.host)
        return self.host_cache

    # ---- admission (scheduler side) -------------------------------------------------
    def max_tokens(self, seq, max_model_len: int) -> int:
        return min(len(seq.prompt_token_ids) + seq.params.max_tokens, max_model_len)

    def may_go_sparse(self, seq, max_model_len: int) -> bool:
        return seq.hand_over or seq.streamed or self.max_tokens(seq, max_model_len) > self.cfg.sparse_threshold

    def streams_prefill(self, seq, num_pages: int) -> bool:
        """Its prompt (and the token after it) does not fit the GPU pool: prefill beyond HBM."""
        return -(-(len(seq.prompt_token_ids) + 1) // self.block_size) > num_pages

    def streamed_pages(self, seq, max_model_len: int) -> int:
        """Pages a streamed prefill holds: enough to stage its chunks (`streamed_prefill`) and
        for its conversion to take its working set and summaries from (one more, as
        `BlockManager.take_own` asks), so it always converts when its prompt is done."""
        blocks = self.max_blocks(seq, max_model_len)
        return max(staging_pages(self.L, blocks), self.conversion_pages(seq, max_model_len) + 1)

    def conversion_pages(self, seq, max_model_len: int) -> int:
        """Pages a request holds once sparse: its working set and its summaries' run."""
        return self.cfg.working_set_blocks + self.arena.pages_for(self.max_blocks(seq, max_model_len))

    def max_blocks(self, seq, max_model_len: int) -> int:
        return math.ceil(self.max_tokens(seq, max_model_len) / self.block_size)

    def reserve(self, seq, max_model_len: int) -> bool:
        """Host bytes for the request's full KV, taken at admission; False = it must wait. The
        host-tier entry its prefix hits is kept while room is made, unless only its eviction
        makes room. A request that stays below the threshold but passes the pressure floor takes
        an extent if the pool has room now (then it converts rather than be preempted when the
        GPU pool runs short), and never waits for one."""
        if getattr(seq, "host_extent", None) is not None:
            return True
        args = (seq.request_id, self.L, self.max_blocks(seq, max_model_len), self.Hkv)
        if not self.may_go_sparse(seq, max_model_len):
            if self.max_tokens(seq, max_model_len) >= self.pressure_floor:
                seq.host_extent = self.host.allocate(*args)
            return True
        hit = self.host_cache.lookup(seq.block_names) if self.host_cache is not None else None
        if hit is not None:
            self.host_cache.pin(hit.entry)
            extent = self.host.allocate(*args)
            self.host_cache.unpin(hit.entry)
        if hit is None or extent is None:
            extent = self.host.allocate(*args)
        seq.host_extent = extent
        return extent is not None

    def release(self, seq) -> None:
        """The request is done: its pipeline row (counters kept in its stats) goes, and its host
        extent goes back to the pool, or, with the host tier on, stays there as cached blocks."""
        self.leave_pipeline(seq)
        ws = seq.sparse
        if ws is not None and ws.remote is not None:
            self.remote.release(ws)
        if getattr(seq, "host_extent", None) is None:
            return
        if self.host_cache is None or ws is None or ws.remote is not None:
            self.host.free(seq.request_id)
        else:
            names = seq.block_names[:ws.exact_blocks]
            kmin, kmax = self.summaries(ws, len(names))
            self.host_cache.keep(seq.request_id, names, kmin, kmax)
        seq.host_extent = None

    def summaries(self, ws, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's first blocks' summaries [L, num_blocks, Hkv, D], copied to the host: their
        pages go back to the pool with the request's."""
        at = slice(ws.summary_offset, ws.summary_offset + num_blocks)
        return self.arena.kmin[:, at].cpu(), self.arena.kmax[:, at].cpu()

    def working_set_tables(self, ws: WorkingSet) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The request's working set as its conversion laid it out (blocks [L, Hkv, P], selection
        stamps [L, Hkv, K]) and the step the stamps count from: from its pipeline row once it has one."""
        if ws.row is None:
            return ws.blocks, ws.last_selected, self.step
        blocks, last = self.pipeline.working_set_of(ws)
        return blocks, last, int(self.pipeline.step)

    def summary_pages(self, seq) -> int:
        """Pages a request's summaries take when it converts (every block it may reach)."""
        return self.arena.pages_for(seq.host_extent.max_blocks)

    def place_summaries(self, ws, kmin: torch.Tensor, kmax: torch.Tensor, run: list[int]) -> None:
        """The request's summaries [L, nb, Hkv, D] into its run of pages (`BlockManager.take_run`),
        where the pipeline's kernels address them (`ws.kmin` and `ws.kmax` are views of the whole
        run until the request's pipeline row takes them over)."""
        nb = kmin.shape[1]
        assert len(run) >= self.arena.pages_for(nb) and run == list(range(run[0], run[0] + len(run)))
        ws.summary_offset = self.arena.offset(run[0])
        self.arena.kmin[:, ws.summary_offset:ws.summary_offset + nb] = kmin
        self.arena.kmax[:, ws.summary_offset:ws.summary_offset + nb] = kmax
        held = slice(ws.summary_offset, self.arena.offset(run[-1] + 1))
        ws.kmin, ws.kmax = self.arena.kmin[:, held], self.arena.kmax[:, held]

    # ---- the prefix cache's host tier (worker side) ---------------------------------
    @torch.inference_mode()
    def load_host_hits(self, seqs) -> None:
        """Before a prefill step: each request admitted on a host-tier hit (`seq.host_load`)
        gets the hit blocks' K/V copied from the host into its GPU pages, and (if it may go
        sparse) their summaries, for its conversion to reuse; then the entry is unpinned."""
        for seq in seqs:
            hit: HostHit | None = seq.host_load
            if hit is None:
                continue
            first, n = hit.first_block, hit.num_blocks
            pages = torch.tensor(seq.pages[first:first + n], device=self.device)
            slots = (pages[:, None] * self.Hkv + torch.arange(self.Hkv, device=self.device)).flatten()
            items = self.host.extent_items(hit.entry.extent)  # [L, max_blocks, H, 2, bs, D]
            for layer in range(self.L):  # a layer's blocks are one contiguous host range
                src = items[layer, first:first + n].flatten(0, 1)
                self.kv[layer][slots] = src.to(self.device)  # synchronous: the entry is unpinned next
            if seq.host_extent is not None:
                end = first + n
                seq.host_summaries = (hit.entry.kmin[:, :end].to(self.device, copy=True),
                                      hit.entry.kmax[:, :end].to(self.device, copy=True))
            self.host_cache.unpin(hit.entry)
            seq.host_load = None

    def leave_pipeline(self, seq) -> None:
        ws = getattr(seq, "sparse", None)
        if ws is not None and ws.row is not None:
            ws.stats.absorb(self.pipeline.release(ws), self.item_bytes)

    def count_step(self, step: dict) -> None:
        """A sparse decode step's figures (`LookaheadPipeline.read_step`) into the totals."""
        self.totals["steps"] += 1
        for k, v in step.items():
            self.totals[k] += v

    @property
    def conversion_floor(self) -> int:
        """Context below which a request never converts: its working set would not be well
        below its context (MIN_CONTEXT_PER_WORKING_SET), so sparse decode would read about as
        many KV bytes as dense and add the pipeline's work on top."""
        return MIN_CONTEXT_PER_WORKING_SET * self.cfg.working_set_blocks * self.block_size

    @property
    def pressure_floor(self) -> int:
        """Context from which a request may convert when the GPU pool runs short: its working
        set then frees a third of its pages or more, and the alternative is a preemption."""
        return int(PRESSURE_CONTEXT_PER_WORKING_SET * self.cfg.working_set_blocks * self.block_size)

    def can_convert(self, seq) -> bool:
        """A dense request that could convert now, instead of a preemption: it holds a host
        extent and its context is past the pressure floor."""
        return seq.sparse is None and getattr(seq, "host_extent", None) is not None \
            and not seq.in_prefill and seq.num_tokens >= self.pressure_floor

    def after_prefill_step(self, seqs, num_tokens) -> None:
        """The completed blocks of prompts that convert when done go to the host now."""
        self.prefill_copies.after_prefill_step(seqs, num_tokens, lambda s: self.should_convert(s, s.num_tokens))

    def pages_freed(self, seq) -> int:
        """GPU pages a dense request gives back by converting (all but its working set's)."""
        return max(0, len(seq.pages) - self.cfg.working_set_blocks)

    def should_convert(self, seq, cached_after_step: int) -> bool:
        """The request converts after this step: its context passes the threshold (by default
        past the floor too: `sparse.config.auto_threshold`), or the scheduler asked for it
        instead of a preemption (`Sequence.convert_early`) and it is past the pressure floor."""
        if seq.sparse is not None or getattr(seq, "host_extent", None) is None:
            return False
        if seq.hand_over or seq.streamed:  # handed over sparse (a prefill instance), or sparse already
            return True
        if getattr(seq, "convert_early", False):
            return cached_after_step >= self.pressure_floor
        return cached_after_step >= self.cfg.sparse_threshold

    # ---- conversion -----------------------------------------------------------------
    @torch.inference_mode()
    def convert(self, seq, last_q: torch.Tensor, new_pages: list[int], summary_run: list[int]) -> None:
        """Dense -> sparse: full KV to the host pool, summaries, working set from the last query.

        last_q: [L, Hq, D] query of the last processed token; new_pages: the working set's;
        summary_run: `summary_pages(seq)` consecutive pages for the summaries. Either may be
        pages the request holds alone (everything is read before they are written). The caller
        frees the other dense pages.
        """
        if seq.streamed:
            return self._convert_from_host(seq, last_q, new_pages, summary_run)
        bs, L, H = self.block_size, self.L, self.Hkv
        n = seq.num_cached_tokens
        nb = -(-n // bs)
        dense_slots = (torch.tensor(seq.pages[:nb], device=self.device)[:, None] * H
                       + torch.arange(H, device=self.device)[None, :])  # [nb, H]
        ext = seq.host_extent
        kmin = torch.empty(L, ext.max_blocks, H, self.D, dtype=self.summary_dtype, device=self.device)
        kmax = torch.empty_like(kmin)
        ws = self._new_working_set(seq, new_pages, n)
        items = self.host.extent_items(ext)  # [L, max_blocks, H, 2, bs, D]
        on_host = min(self.prefill_copies.taken(seq), nb)  # copied while the prompt prefilled
        # The leading blocks' summaries from a host-tier hit, as they were computed (the same K).
        reused = 0
        if seq.host_summaries is not None:
            reused = min(seq.host_summaries[0].shape[1], n // bs)
            kmin[:, :reused] = seq.host_summaries[0][:, :reused]
            kmax[:, :reused] = seq.host_summaries[1][:, :reused]
            seq.host_summaries = None
        # Every layer's blocks go to the host and into summaries without a sync between layers.
        for layer in range(L):
            block_kv = self.kv[layer][dense_slots]  # [nb, H, 2, bs, D]
            items[layer, on_host:nb].copy_(block_kv[on_host:], non_blocking=True)
            keys = block_kv[reused:, :, 0].transpose(1, 2).reshape((nb - reused) * bs, H, self.D)[:n - reused * bs]
            write_block_minmax(kmin[layer, reused:], kmax[layer, reused:], keys, bs)
        dev = self.device
        pred = self._conversion_topk(last_q, kmin, kmax, n // bs, ws.window_start(n, bs)).cpu()  # the one sync
        self._fill_working_set(ws, pred, n)
        # Copy every held block from its dense page into its working-set slot (GPU -> GPU); the
        # host copies above read gathered copies, so new pages may be the request's own.
        l_idx, h_idx, p_idx = (i.to(dev) for i in torch.nonzero(ws.blocks >= 0, as_tuple=True))
        src = dense_slots[ws.blocks.to(dev)[l_idx, h_idx, p_idx].long(), h_idx]
        dst = torch.tensor(new_pages, device=dev)[p_idx] * H + h_idx
        self.kv[l_idx, dst] = self.kv[l_idx, src]
        self._finish_conversion(seq, ws, kmin, kmax, summary_run, n)

    def _new_working_set(self, seq, pages: list[int], num_tokens: int) -> WorkingSet:
        cfg, L, H = self.cfg, self.L, self.Hkv
        return WorkingSet(cfg, pages, seq.host_extent,
                          blocks=torch.full((L, H, cfg.working_set_blocks), -1, dtype=torch.int32),
                          last_selected=torch.full((L, H, cfg.top_k_blocks), -1, dtype=torch.int64),
                          kmin=None, kmax=None, exact_blocks=num_tokens // self.block_size)

    def _fill_working_set(self, ws: WorkingSet, pred: torch.Tensor, num_tokens: int) -> None:
        """Sinks, the window and the predicted top-K `pred` [L, H, K] as the working set's blocks."""
        cfg, bs = self.cfg, self.block_size
        win_start, cur = ws.window_start(num_tokens, bs), num_tokens // bs
        held = cur + (1 if num_tokens % bs else 0)  # blocks with a token
        sinks_and_window = list(range(min(cfg.sink_blocks, held))) + list(range(win_start, held))
        positions = [ws.position(b) for b in sinks_and_window]
        ws.blocks[:, :, positions] = torch.tensor(sinks_and_window, dtype=torch.int32)
        ws.blocks[:, :, ws.dynamic] = pred
        ws.last_selected.copy_(torch.where(pred >= 0, self.step, -1))

    def _finish_conversion(self, seq, ws: WorkingSet, kmin: torch.Tensor, kmax: torch.Tensor,
                           summary_run: list[int], num_tokens: int) -> None:
        self.place_summaries(ws, kmin, kmax, summary_run)
        # The first sparse step has no draft row to take an argmax from: start the chain with
        # prompt lookup instead of a copy of the current token (a cold start measured in
        # docs/accuracy.md as one step of `prev`-quality prediction).
        ws.history = TokenHistory(seq.token_ids)
        ws.draft = next_draft(self.cfg.drafter, ws.history, None, seq.last_token_id, None)
        seq.sparse = ws
        self.num_conversions += 1
        if self.pipeline is not None:
            self.pipeline.adopt(ws, num_tokens)

    def _convert_from_host(self, seq, last_q: torch.Tensor, new_pages: list[int], summary_run: list[int]) -> None:
        """`convert` of a streamed prefill: its K/V is in the host extent alone, so the summaries
        and the working set are read from there, a layer at a time."""
        bs, L, H = self.block_size, self.L, self.Hkv
        n, ext = seq.num_cached_tokens, seq.host_extent
        nb = -(-n // bs)
        kmin = torch.empty(L, ext.max_blocks, H, self.D, dtype=self.summary_dtype, device=self.device)
        kmax = torch.empty_like(kmin)
        items = self.host.extent_items(ext)  # [L, max_blocks, H, 2, bs, D]
        for layer in range(L):
            keys = items[layer, :nb, :, 0].to(self.device).transpose(1, 2).reshape(nb * bs, H, self.D)[:n]
            write_block_minmax(kmin[layer], kmax[layer], keys, bs)
        ws = self._new_working_set(seq, new_pages, n)
        pred = self._conversion_topk(last_q, kmin, kmax, n // bs, ws.window_start(n, bs)).cpu()
        self._fill_working_set(ws, pred, n)
        layer, head, pos = torch.nonzero(ws.blocks >= 0, as_tuple=True)
        block = ws.blocks[layer, head, pos].long()
        dst = (torch.tensor(new_pages)[pos] * H + head).to(self.device)
        self.kv[layer.to(self.device), dst] = items[layer, block, head].to(self.device)
        self._finish_conversion(seq, ws, kmin, kmax, summary_run, n)

    def _conversion_topk(self, last_q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                         cur: int, win_start: int) -> torch.Tensor:
        """The top-K of every layer in one scan, each layer's summaries [L, max_blocks, H, D]
        taken as a sequence; the scan is `scan_blocks` wide (blocks past `cur` score -inf)."""
        L, max_blocks, H, D = kmin.shape
        dev = self.device
        pred, _ = score_topk(last_q, kmin.view(L * max_blocks, H, D), kmax.view(L * max_blocks, H, D),
                             torch.arange(L, device=dev) * max_blocks, torch.full((L,), cur + 1, device=dev),
                             self.G, self.cfg.top_k_blocks, max_blocks=max(max_blocks, self.scan_blocks),
                             num_sink=self.cfg.sink_blocks, window_start=torch.full((L,), win_start, device=dev))
        return pred

    def warm_up_conversion(self, query_dtype: torch.dtype) -> None:
        """Compile the conversion's prediction kernels now rather than at the first request's
        conversion (which stops the engine loop while they build)."""
        L, M, H = self.L, max(self.scan_blocks, 1), self.Hkv
        q = torch.zeros(L, H * self.G, self.D, dtype=query_dtype, device=self.device)
        summaries = torch.zeros(L, M, H, self.D, dtype=self.summary_dtype, device=self.device)
        self._conversion_topk(q, summaries, summaries.clone(), M - 1, max(M - self.cfg.window_blocks, 0))
