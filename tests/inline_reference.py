"""The in-line per-request sparse decode step: the reference the pipeline is checked against
(tests/sparse/test_pipeline.py and others compare tokens and counters with it).

The same stages as `oasiskv.sparse.pipeline.LookaheadPipeline`, per request and in order, after
each layer's attention, on the working set's own tensors (`WorkingSet.blocks`, `kmin`, `kmax`):

    predict  (score every block from the summaries with the draft query, top-K per KV head)
    select   (capped eviction: which predicted blocks come in, which LRU blocks leave)
    transfer (copy the admitted (layer, block, head) items host -> their GPU slots)

A batch runs two query rows per request (the token and its lookahead draft; a dense request's
second row is padding). `inline_llm` builds an engine whose sparse requests decode here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from oasiskv import LLM
from oasiskv.disagg.decode_side import ARENA_FULL, RemoteSource
from oasiskv.disagg.remote_reads import HostArenaFull
from oasiskv.engine.sampler import sample_requests
from oasiskv.engine.sequence import Sequence
from oasiskv.kernels.qkv_epilogue import SummaryFold
from oasiskv.kernels.summary_fold import update_block_minmax
from oasiskv.layers.attention import AttentionMetadata
from oasiskv.sparse.block_scores import score_topk
from oasiskv.sparse.capped_eviction import EvictionPlan, admission_ranks, capped_eviction
from oasiskv.sparse.drafters import Drafter, next_draft
from oasiskv.sparse.fetch_budget import FetchBudget, share_budget
from oasiskv.sparse.manager import SparseManager
from oasiskv.sparse.working_set import WorkingSet


def inline_llm(**engine_args) -> LLM:
    """An engine whose decode steps with sparse requests run the in-line reference (its
    pipeline dropped: conversions keep their working sets on the request)."""
    llm = LLM(**engine_args)
    runner = llm.engine.runner
    runner.pipeline = runner.sparse.pipeline = runner.sparse_runner.pipeline = None
    reference = InlineReference(runner.sparse, runner.sparse_runner)
    run = runner.execute

    @torch.inference_mode()
    def execute(batch):
        if not batch.is_prefill and any(s.sparse is not None for s in batch.seqs):
            return reference.run_sparse_decode(batch.seqs)
        return run(batch)
    runner.execute = execute
    return llm


@dataclass
class Prediction:
    """Output of the predict stage for one (request, layer)."""
    blocks: torch.Tensor  # [Hkv, K] int32 best first, -1 none
    window_start: int  # first window block of the step predicted for
    num_blocks: int  # blocks that exist at that step
    scores: torch.Tensor | None = None  # [Hkv, K] their scores


@dataclass
class TransferPlan:
    """Output of the select stage: host items to copy into GPU slots of one layer."""
    layer: int
    host_items: torch.Tensor  # [N] indices into the host arena
    gpu_slots: torch.Tensor  # [N] slots of the layer's KV pool
    source: torch.Tensor | None = None  # the arena host_items index; None: the host pool's


@dataclass
class SparseRow:
    batch_index: int  # b: its tokens are rows b*Q (the real token) and b*Q+1 (the draft)
    ws: WorkingSet
    cached: int  # tokens in the cache before this step's token


class InlineReference:
    def __init__(self, manager: SparseManager, runner):
        """runner: the engine's SparseRunner (its samples and the conversions' recorded queries)."""
        self.m, self.runner = manager, runner
        self.budget = FetchBudget(manager.cfg.fetch_budget, manager.item_bytes, manager.L)

    # ---- the three stages -----------------------------------------------------------
    def predict(self, ws: WorkingSet, layer: int, query: torch.Tensor, cached: int) -> Prediction:
        """Top-K blocks per KV head for the step that adds token number `cached`.

        query: [Hq, D] post-RoPE (the draft's, or the current token's when no draft token is sent).
        Sinks and window are always resident, so they are left out of the K.
        """
        win = ws.window_start(cached, self.m.block_size)
        nb = cached // self.m.block_size + 1
        ids, scores = score_topk(query[None], ws.kmin[layer], ws.kmax[layer],
                            torch.zeros(1, dtype=torch.long, device=self.m.device),
                            torch.tensor([nb], device=self.m.device), self.m.G, self.m.cfg.top_k_blocks,
                            max_blocks=ws.kmin.shape[1], num_sink=self.m.cfg.sink_blocks,
                            window_start=torch.tensor([win], device=self.m.device))
        blocks = ids[0] if ws.remote is None else remote_available(self.m.remote, ws, layer, ids[0])
        return Prediction(blocks, win, nb, scores[0])

    def select(self, ws: WorkingSet, layer: int, pred: Prediction, cap: int,
               row_cap: torch.Tensor | None = None) -> tuple[EvictionPlan, TransferPlan]:
        dyn = ws.dynamic
        plan = capped_eviction(ws.blocks[layer][:, dyn], ws.last_selected[layer], pred.blocks.cpu(),
                               self.m.cfg.sink_blocks, torch.full((self.m.Hkv,), pred.window_start),
                               cap, self.m.step, row_cap)
        heads, cols = torch.nonzero(plan.admit_blocks >= 0, as_tuple=True)
        blocks = plan.admit_blocks[heads, cols].long()
        positions = plan.admit_slots[heads, cols].long() + self.m.cfg.sink_blocks
        pages = torch.tensor(ws.pages)[positions]
        gpu_slots = (pages * self.m.Hkv + heads).to(self.m.device)
        if ws.remote is not None:
            transfer = TransferPlan(layer, remote_item_index(ws, layer, blocks, heads), gpu_slots,
                                    self.m.remote.items)
        else:
            transfer = TransferPlan(layer, self.m.host.item_index(ws.extent, layer, blocks, heads), gpu_slots)
        return plan, transfer

    def transfer(self, plan: TransferPlan) -> int:
        """Host -> GPU copy of the admitted items; returns bytes moved."""
        if plan.host_items.numel():
            source = self.m.host.items if plan.source is None else plan.source
            self.m.kv[plan.layer][plan.gpu_slots] = source[plan.host_items].to(self.m.device, non_blocking=True)
        return plan.host_items.numel() * self.m.item_bytes

    def apply(self, ws: WorkingSet, layer: int, plan: EvictionPlan, transferred: int) -> None:
        ws.blocks[layer][:, ws.dynamic] = plan.resident
        ws.last_selected[layer] = plan.last_selected
        st = ws.stats
        st.predicted += int((plan.hits + plan.missed).sum())
        st.hits += int(plan.hits.sum())
        st.admitted += int(plan.admitted.sum())
        st.evicted += int(plan.evicted.sum())
        st.bytes_to_device += transferred
        t = self.m.totals
        t["bytes"] += transferred
        t["hits"] += int(plan.hits.sum())
        t["predicted"] += int((plan.hits + plan.missed).sum())

    def prefetch(self, ws: WorkingSet, layer: int, query: torch.Tensor, cached: int, cap: int) -> None:
        """predict -> select -> transfer, in line (the CPU path and the reference for the pipeline)."""
        pred = self.predict(ws, layer, query, cached)
        plan, transfer = self.select(ws, layer, pred, cap)
        self.apply(ws, layer, plan, self.transfer(transfer))

    def prefetch_layer(self, rows: list[tuple[WorkingSet, torch.Tensor, int]], layer: int) -> None:
        """`prefetch` of one layer for every (working set, query, cached) of a step, the rows
        sharing the step's transfer budget as the pipeline's select stage shares it
        (`fetch_budget`): each row's candidates, every row's share, then the admissions."""
        if not self.budget.enabled or not rows:
            for ws, query, cached in rows:
                self.prefetch(ws, layer, query, cached, self.m.cfg.fetch_cap)
            return
        preds = [self.predict(ws, layer, q, cached) for ws, q, cached in rows]
        ranks, scores = [], []
        for (ws, _, _), pred in zip(rows, preds):
            plan, _ = self.select(ws, layer, pred, self.m.cfg.fetch_cap)
            r, sc = admission_ranks(plan.admit_blocks, pred.blocks.cpu(), pred.scores.float().cpu())
            ranks.append(r), scores.append(sc)
        share = share_budget(torch.cat(ranks), torch.cat(scores), self.budget.items_per_layer)
        for i, ((ws, _, _), pred) in enumerate(zip(rows, preds)):
            row_cap = share[i * self.m.Hkv:(i + 1) * self.m.Hkv]
            plan, transfer = self.select(ws, layer, pred, self.m.cfg.fetch_cap, row_cap)
            self.apply(ws, layer, plan, self.transfer(transfer))

    # ---- per-step tables and write-through ------------------------------------------
    def attention_tables(self, ws: WorkingSet, cached: int, layers: slice = slice(None)
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot table [L, H, P] and cached-token counts [L, H] for a step adding token `cached`."""
        cfg, bs, H = self.m.cfg, self.m.block_size, self.m.Hkv
        window, partial = ws.window_positions(cached, bs)
        full_sinks = list(range(min(cfg.sink_blocks, cached // bs)))  # a partial sink comes last, with the window
        order = full_sinks + list(range(cfg.sink_blocks, cfg.sink_blocks + cfg.top_k_blocks)) + window
        order_t = torch.tensor(order, dtype=torch.long)
        valid = ws.blocks[layers][:, :, order_t] >= 0  # [L, H, n]
        # Valid positions first, in order: full blocks, then the partial window block last.
        rank = torch.where(valid, torch.arange(len(order))[None, None, :], len(order) + 1)
        sorted_pos = order_t[rank.argsort(dim=-1, stable=True)]  # [L, H, n]
        pages = torch.tensor(ws.pages, dtype=torch.long)
        slots = pages[sorted_pos] * H + torch.arange(H)[None, :, None]
        count = valid.sum(-1)
        cache_lens = (count - (1 if partial else 0)) * bs + partial
        return slots.int(), cache_lens.int()

    def write_slots(self, ws: WorkingSet, cached: int) -> list[int]:
        """GPU slot of each KV head for the token being added (its block's window position)."""
        page = ws.pages[ws.position(cached // self.m.block_size)]
        return [page * self.m.Hkv + h for h in range(self.m.Hkv)]

    def start_token(self, ws: WorkingSet, cached: int) -> None:
        """Book the new token's block into the window ring (it replaces the oldest window block,
        already written through to the host)."""
        b = cached // self.m.block_size
        if cached % self.m.block_size == 0:
            ws.blocks[:, :, ws.position(b)] = b

    def update_summaries(self, ws: WorkingSet, layer: int, key: torch.Tensor, cached: int) -> None:
        """key: [H, D] post-RoPE key of the token added at position `cached`."""
        b = cached // self.m.block_size
        update_block_minmax(ws.kmin[layer], ws.kmax[layer], torch.tensor([b], device=self.m.device),
                            key[None], torch.tensor([cached % self.m.block_size == 0], device=self.m.device))

    def write_through(self, ws: WorkingSet, cached: int) -> None:
        """After the token at position `cached` is stored: a completed block goes to the host."""
        if (cached + 1) % self.m.block_size:
            return
        b = cached // self.m.block_size
        slots = torch.tensor(self.write_slots(ws, cached), device=self.m.device)
        if ws.remote is not None:
            remote_write_block(self.m.remote, ws, b, self.m.kv[:, slots])
            return
        items = self.m.host.extent_items(ws.extent)
        items[:, b].copy_(self.m.kv[:, slots].to(items.device))

    def prepare_mixed_decode(self, seqs: list[Sequence]):
        """Dense and sparse requests in one batch: two query rows per request (the token and
        its lookahead draft; a dense request's second row is padding), per-layer slot tables."""
        r, m = self.runner, self.m
        L, H, bs, Q = m.L, m.Hkv, m.block_size, 2
        B = len(seqs)
        width = max(m.cfg.working_set_blocks if s.sparse else len(s.pages) for s in seqs)
        slot_tables = torch.zeros(L, B, H, width, dtype=torch.int32)
        cache_lens = torch.zeros(L, B, H, dtype=torch.int32)
        ids, pos, wslots, woffs, rows, record = [], [], [], [], [], {}
        heads = torch.arange(H)
        last_pos = r.model_config.max_position_embeddings - 1
        for b, s in enumerate(seqs):
            n, tok = s.num_tokens - 1, s.last_token_id
            draft = s.sparse.draft if s.sparse is not None and s.sparse.draft is not None else tok
            ids += [tok, draft]
            pos += [n, min(n + 1, last_pos)]
            woffs += [n % bs, 0]
            if s.sparse is None:
                page = s.pages[n // bs]
                wslots += [[page * H + h for h in range(H)], [-1] * H]
                pt = torch.tensor(s.pages)
                slot_tables[:, b, :, :len(s.pages)] = (pt[None, :] * H + heads[:, None]).int()
                cache_lens[:, b] = n
                if m.should_convert(s, n + 1):
                    record[b * Q] = r.record_query(s)
            else:
                self.start_token(s.sparse, n)
                wslots += [self.write_slots(s.sparse, n), [-1] * H]
                st, cl = self.attention_tables(s.sparse, n)
                slot_tables[:, b, :, :st.shape[-1]] = st
                cache_lens[:, b] = cl
                rows.append(SparseRow(b, s.sparse, n))
        dev = m.device
        meta = AttentionMetadata(
            write_slots=torch.tensor(wslots, dtype=torch.int32, device=dev),
            write_offsets=torch.tensor(woffs, dtype=torch.int32, device=dev),
            slot_tables=slot_tables.to(dev), cache_lens=cache_lens.to(dev), query_len=Q,
            num_splits=r.attention_splits if width == m.cfg.working_set_blocks else None,
            hooks=SparseStepHooks(self, rows, Q, m.drafter, record_rows=record))
        return torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta

    def run_sparse_decode(self, seqs: list[Sequence]) -> list[int]:
        """One decode step of a batch holding sparse requests (eager; in-line prefetch)."""
        m, model = self.m, self.runner.model
        m.step += 1
        ids, positions, meta = self.prepare_mixed_decode(seqs)
        if meta.hooks.rows:  # the in-line path's bytes and hits are counted as each layer applies them
            m.count_step({})
        hooks, Q = meta.hooks, meta.query_len
        if hooks.drafter.first_pass and hooks.rows:
            # A first pass finds the next token, the second uses it as draft.
            hooks.prefetch = False
            hidden = model(ids, positions, self.runner.kv_caches, meta)
            tokens = sample_requests(model.compute_logits(hidden[::Q]), seqs).tolist()
            for r in hooks.rows:
                ids[r.batch_index * Q + 1] = tokens[r.batch_index]
                r.ws.draft = tokens[r.batch_index]
            hooks.prefetch, hooks.record_rows = True, {}
            model(ids, positions, self.runner.kv_caches, meta)
            guesses = [None] * len(seqs)  # the draft is set by the first pass
        else:
            hidden = model(ids, positions, self.runner.kv_caches, meta)
            logits = model.compute_logits(hidden)
            samples = self.runner._lookahead_samples(seqs, logits[::Q], logits[1::Q], ids[1::Q])
            tokens, guesses = torch.stack(samples).tolist()
        for r in hooks.rows:
            self.write_through(r.ws, r.cached)
            self._advance(r.ws, hooks.drafter, tokens[r.batch_index], guesses[r.batch_index])
        return tokens

    @staticmethod
    def _advance(ws, drafter: Drafter, tok: int, guess: int | None) -> None:
        """After an in-line step: count it, then pick the next draft on the host (a first
        pass's drafter finds its own instead)."""
        ws.stats.steps += 1
        if drafter.sends_draft_token:
            ws.stats.drafts += 1
            ws.stats.drafts_accepted += int(ws.draft == tok)
        ws.history.append(tok)
        if not drafter.first_pass:
            ws.draft = next_draft(drafter.name, ws.history, ws.draft, tok, guess)


@dataclass
class SparseStepHooks:
    manager: InlineReference
    rows: list[SparseRow]
    query_len: int
    drafter: Drafter
    prefetch: bool = True  # off for a first pass (`Drafter.first_pass`)
    record_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # token row -> [L, Hq, D]

    def summary_fold(self, layer: int) -> SummaryFold | None:
        return None  # the in-line path folds per request, after attention

    def before_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata) -> None:
        if not (self.drafter.retrieves_on_demand and self.prefetch):
            return
        # Quest/ArkVale-style retrieval: this token's own query, fetched on the critical path.
        m = self.manager
        for r in self.rows:
            m.prefetch(r.ws, layer, q[r.batch_index * self.query_len], r.cached, m.m.cfg.top_k_blocks)
            slots, lens = m.attention_tables(r.ws, r.cached, layers=slice(layer, layer + 1))
            n = slots.shape[-1]
            meta.slot_tables[layer, r.batch_index, :, :n] = slots[0].to(meta.slot_tables.device)
            meta.cache_lens[layer, r.batch_index] = lens[0].to(meta.cache_lens.device)

    def after_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata) -> None:
        for row, buf in self.record_rows.items():
            buf[layer] = q[row]
        m, Q = self.manager, self.query_len
        for r in self.rows:
            m.update_summaries(r.ws, layer, k[r.batch_index * Q], r.cached)
        if self.prefetch and not self.drafter.retrieves_on_demand:
            # The lookahead query predicts step t+1's blocks; without a draft token, the current token's.
            draft = 1 if self.drafter.sends_draft_token else 0
            m.prefetch_layer([(r.ws, q[r.batch_index * Q + draft], r.cached + 1) for r in self.rows], layer)

    def fork_point(self, layer: int, part: str) -> None:
        return None  # the in-line path runs its stages inside `after_attention`


# ---- a decode instance's disaggregated working sets (`SparseManager.remote`: a RemoteSource) ----

def remote_available(self: RemoteSource, ws: WorkingSet, layer: int, blocks: torch.Tensor) -> torch.Tensor:
    """The predicted blocks [Hkv, K] (-1: none) with those not local yet masked to -1 (strict:
    read and waited for first)."""
    self.reads.poll()  # arrived blocks count from the next step; failures are seen at once
    b = blocks.cpu()
    heads, cols = torch.nonzero(b >= 0, as_tuple=True)
    want, head = b[heads, cols].long().numpy(), heads.numpy()
    local = self.reads.want(ws.remote, layer, want, head)
    if self.strict:
        self.reads.flush()
        self.reads.wait()
        local = ws.remote.where[layer, want, heads.numpy()] >= 0
    elif layer == self.num_layers - 1:
        self.reads.flush(self.budget_bytes)
    if local.all():
        return blocks
    out = b.clone()
    out[heads[~torch.from_numpy(local)], cols[~torch.from_numpy(local)]] = -1
    return out.to(blocks.device)

def remote_item_index(ws: WorkingSet, layer: int, blocks: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """Local items of (layer, block, head): only blocks `available` let through come here."""
    idx = ws.remote.where[layer, blocks.numpy(), heads.numpy()]
    if (idx < 0).any():
        raise RuntimeError("a block admitted to the working set is not local")
    return torch.from_numpy(idx)

def remote_write_block(self: RemoteSource, ws: WorkingSet, block: int, kv: torch.Tensor) -> None:
    """The write-through of a block the decode side completed: kv [L, Hkv, 2, bs, D]."""
    L, H = kv.shape[:2]
    local = self.reads.place(ws.remote, np.arange(L)[:, None], block, np.arange(H)[None, :])
    if local is None:  # this request ends after the step; the others go on
        self.reads.fail_request(ws.remote, HostArenaFull(ws.remote.peer, ARENA_FULL))
        return
    self.items[torch.from_numpy(local.reshape(L * H))] = kv.reshape(L * H, *kv.shape[2:]).to(self.items.device)
