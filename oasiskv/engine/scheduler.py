"""Continuous batching: decides, each step, which sequences run and how many tokens each.

A step is either a prefill step (chunks of prompts, up to `max_num_batched_tokens`) or a
decode step (one new token for every running sequence). Prefill goes first so new
requests join the running batch quickly, but never twice in a row while requests wait to
decode: a decode step runs between two chunks, so a long prompt delays the running requests'
next token by one chunk's time, not by its whole prefill. Long prompts are cut into chunks so
a 32K prompt never needs 32K tokens of activations at once. A new request's leading blocks found in
the prefix cache are shared and its prefill starts after them; one whose next block another
request computes in the same step waits a step, and then finds it cached. When pages run out
during decode the newest running sequence is preempted and later recomputed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from oasiskv.engine.block_manager import BlockManager
from oasiskv.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens each sequence processes this step
    is_prefill: bool


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 sparse=None, max_model_len: int = 0):
        self.block_manager = block_manager
        self.sparse = sparse  # SparseManager: host-pool admission for requests that will go sparse
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # every preemption so far (oasiskv:num_preemptions_total)
        self.last_was_prefill = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        if self.last_was_prefill and self.has_decode_ready():
            batch = self._schedule_decode() or self._schedule_prefill()
        else:
            batch = self._schedule_prefill() or self._schedule_decode()
        self.last_was_prefill = batch is not None and batch.is_prefill
        return batch

    def has_decode_ready(self) -> bool:
        return any(not s.in_prefill for s in self.running)

    def has_prefill_ready(self) -> bool:
        """A chunked prefill or a waiting request could take the next step."""
        return bool(self.waiting) or any(s.in_prefill for s in self.running)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        bm, budget = self.block_manager, self.max_num_batched_tokens
        streamed = next((s for s in self.running if s.streamed and s.in_prefill), None)
        if streamed is not None:  # a prefill beyond HBM takes its steps alone, block-aligned chunks
            return ScheduledBatch([streamed], [self._streamed_chunk(streamed)], True)
        seqs, sizes = [], []
        computing: set[bytes] = set()  # names of the blocks this step computes
        for seq in self.running:  # unfinished chunked prefills first
            if seq.in_prefill and budget > 0:
                n = min(seq.num_uncached, budget)
                if bm.can_grow(seq, seq.num_cached_tokens + n):
                    computing.update(bm.names_computed(seq, n))
                    bm.grow(seq, seq.num_cached_tokens + n)
                    seqs.append(seq), sizes.append(n)
                    budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.sparse is not None and self.sparse.streams_prefill(seq, bm.num_pages):
                seq.streamed = True
                if seqs or not self._admit_streamed(seq):
                    break  # it starts alone, once its host extent and staging pages are there
                return ScheduledBatch([seq], [self._streamed_chunk(seq)], True)
            hits = bm.cached_prefix(seq)  # its leading blocks already in the cache: shared, not prefilled
            if bm.next_block_name(seq, hits) in computing:
                break  # its next block is computed in this step (another request's): it hits it next step
            if self.sparse is not None and not self.sparse.reserve(seq, self.max_model_len):
                break  # its full KV does not fit the host pool yet: it waits
            if seq.hand_over and not self._hand_over_room(seq, len(hits)):
                break
            host_hit = bm.host_prefix(seq, hits)  # the next blocks, in the host tier: loaded, not prefilled
            cached = len(hits) * bm.block_size + (host_hit.num_tokens if host_hit else 0)
            n = min(seq.num_tokens - cached, budget)
            if not bm.can_admit(seq, hits, cached + n):
                break
            self.waiting.popleft()
            bm.admit(seq, hits, host_hit)
            computing.update(bm.names_computed(seq, n))
            bm.grow(seq, cached + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq), sizes.append(n)
            budget -= n
        return ScheduledBatch(seqs, sizes, True) if seqs else None

    def _admit_streamed(self, seq: Sequence) -> bool:
        """A prompt longer than the pool (`streamed_prefill`): its full KV reserved in the host
        pool and a run of staging pages, or it waits."""
        if not self.sparse.reserve(seq, self.max_model_len):
            return False
        run = self.block_manager.take_run(self.sparse.streamed_pages(seq, self.max_model_len))
        if run is None:
            return False
        self.waiting.popleft()
        seq.pages, seq.num_cached_tokens = run, 0
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _hand_over_room(self, seq: Sequence, held: int) -> bool:
        """A request a prefill instance hands over converts right after its prompt: admitted
        only while the pages for its whole prompt or its conversion (working set and summaries'
        run, `take_own`'s one more), whichever is more, stay free beside those the admitted
        hand-overs still need; else it waits rather than fail at its conversion."""
        bm = self.block_manager

        def need(s: Sequence) -> int:
            prompt = -(-len(s.prompt_token_ids) // bm.block_size)
            return max(prompt, self.sparse.conversion_pages(s, self.max_model_len) + 1)
        reserved = sum(max(0, need(s) - len(s.pages)) for s in self.running if s.hand_over and s.sparse is None)
        return bm.num_free - reserved >= need(seq) - held or not self.running  # alone, it tries

    def _streamed_chunk(self, seq: Sequence) -> int:
        """Its next chunk: the step's token budget in whole blocks (so every chunk but the last
        ends on a block boundary), or the rest of the prompt."""
        bs = self.block_manager.block_size
        return min(seq.num_uncached, max(bs, self.max_num_batched_tokens // bs * bs))

    def _schedule_decode(self) -> ScheduledBatch | None:
        bm = self.block_manager
        seqs = []
        pending = [s for s in self.running if not s.in_prefill]
        if self._convert_ahead(pending):  # the requests converting go first: they must run this step
            pending.sort(key=lambda s: not s.convert_early)
        while pending:
            seq = pending.pop(0)
            if seq.sparse is not None:  # a fixed working set: no page to add
                seqs.append(seq)
                continue
            if seq.streamed:  # its pages are a staging run: it decodes once converted
                continue
            if not bm.can_grow(seq, seq.num_tokens) and any(s.convert_early for s in seqs):
                continue  # it waits one step: a conversion after this step frees pages
            while not bm.can_grow(seq, seq.num_tokens):
                victim = self._victim(seq, seqs)
                pending = [p for p in pending if p is not victim]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                bm.grow(seq, seq.num_tokens)
                seqs.append(seq)
        if not seqs and self.running:
            # Only stalled chunked prefills remain and none can grow: free the newest one.
            self.preempt(self.running[-1])
            return self._schedule_prefill()
        return ScheduledBatch(seqs, [1] * len(seqs), False) if seqs else None

    def _victim(self, seq: Sequence, scheduled: list[Sequence]) -> Sequence:
        """Whom `seq` preempts for a page: the newest running request admitted after it and not
        in this step's batch, chunked prefills included (spared, an older request would preempt
        itself for a newer prefill, which then loses its pages to it again: a livelock); else itself."""
        for s in reversed(self.running):
            if s is seq:
                break
            if not any(s is x for x in scheduled):
                return s
        return seq

    def _convert_ahead(self, pending: list[Sequence]) -> bool:
        """Convert instead of preempting: while fewer pages are free (counting those the
        conversions already asked for will give back) than there are dense requests, which may
        all need a page at the same step, every dense request that can go sparse is asked to
        convert after the step it next runs in (which records its query; it keeps its working
        set in pages of its own and gives the rest back): together, so the batch spends one
        step converting rather than many steps half dense, half sparse (two forward passes
        each). True if any is converting."""
        if self.sparse is None:
            return False
        dense = [s for s in pending if s.sparse is None]
        early = [s for s in dense if s.convert_early]
        bm = self.block_manager
        free = bm.num_free + sum(max(0, self.sparse.pages_freed(s) - bm.num_shared(s)) for s in early)
        if free < len(dense):  # every one that can goes now: one conversion step, not many mixed ones
            for s in dense:
                if not s.convert_early and self.sparse.can_convert(s):
                    s.convert_early = True
                    early.append(s)
        return bool(early)

    def preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the pages, queue the tokens again."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        if self.sparse is not None:
            self.sparse.leave_pipeline(seq)
        seq.sparse = None  # recomputed dense, converted again (its host extent stays reserved)
        seq.convert_early = False
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.sparse is not None:  # first: the host tier copies its summaries out of its pages
            self.sparse.release(seq)
        self.block_manager.free(seq)
        seq.grammar = None  # its matcher goes with it (finished, failed or aborted)
        seq.status = SequenceStatus.FINISHED
