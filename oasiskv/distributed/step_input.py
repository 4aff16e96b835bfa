"""What rank 0 tells the other ranks before each step, and their mirror of its requests.

Rank 0 owns the scheduler and the requests (`Sequence`). The other ranks keep a mirror of each
request that has run, holding what their model runner reads: its tokens, page table, cached
count, host extent and, once sparse, their own working set (of their own KV heads). Before a
step rank 0 sends a `StepInput` with what changed since the last one (as vLLM's scheduler
output does), and every rank then runs the same batch. Sampled tokens are rank 0's: the
others' samples are dropped, and rank 0's arrive with the next step. Under async scheduling a
step's inputs are rank 0's samples of the step still running: they go from rank 0's device to
the others' (`ParallelGroup.broadcast`), and reach the mirrors' token lists a step later (a
token still on the device stands as `PENDING` in both).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.engine.sequence import PENDING, Sequence
from oasiskv.sampling_params import SamplingParams
from oasiskv.sparse.host_pool import HostExtent


@dataclass(slots=True)
class RequestUpdate:
    request_id: str
    new_tokens: list[int]  # the known tokens past those the ranks hold (the whole prompt at first sight)
    pending: int  # tokens after them still on the device (async scheduling), PENDING until known
    num_cached_tokens: int
    convert_early: bool
    sparse: bool
    params: SamplingParams | None = None  # at first sight, without logits processors
    num_prompt_tokens: int | None = None  # at first sight
    pages: list[int] | None = None  # None: unchanged
    host_extent: HostExtent | None = None  # when it first holds one
    draft: int | None = None  # a sparse request's draft token, chosen on rank 0
    row: int | None = None  # its pipeline row on rank 0 (every rank's must be the same)


@dataclass(slots=True)
class Conversion:
    """Rank 0 converted a request to sparse after the last step (`SparseManager.convert`)."""
    request_id: str
    num_cached_tokens: int
    dense_pages: list[int]
    working_set_pages: list[int]
    summary_run: list[int]


@dataclass(slots=True)
class LeavePipeline:
    """Rank 0 took a request out of its pipeline row after the last step (finished or
    preempted); the last row moved into its place (`LookaheadPipeline.release`)."""
    request_id: str


@dataclass(slots=True)
class StepInput:
    requests: list[RequestUpdate]  # the batch, in order
    num_tokens: list[int]
    is_prefill: bool
    # Conversions and pipeline leaves since the last step, in rank 0's order: each moves
    # pipeline rows, and a row must hold the same request on every rank (the all-reduces add
    # the ranks' rows position by position).
    row_changes: list[Conversion | LeavePipeline] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # requests gone since the last step
    launch: bool = False  # a decode step that does not wait for its tokens (`launch_decode`)
    device_ids: tuple[int, ...] | None = None  # launch: the shape of rank 0's input ids, broadcast next


@dataclass(slots=True)
class _Sent:
    seq: Sequence
    num_tokens: int  # known tokens sent
    pages: list[int]
    has_extent: bool


class StepInputBuilder:
    """Rank 0: turns each scheduled batch into a `StepInput` of what the other ranks lack."""

    def __init__(self):
        self.sent: dict[str, _Sent] = {}
        self.row_changes: list[Conversion | LeavePipeline] = []

    def record_conversion(self, seq: Sequence, pages: list[int], summary_run: list[int]) -> None:
        self.row_changes.append(Conversion(seq.request_id, seq.num_cached_tokens, list(seq.pages), list(pages),
                                           list(summary_run)))

    def record_leave(self, seq: Sequence) -> None:
        self.row_changes.append(LeavePipeline(seq.request_id))

    def build(self, batch: ScheduledBatch, device_ids: tuple[int, ...] | None = None,
              launch: bool = False) -> StepInput:
        gone = [rid for rid, s in self.sent.items() if s.seq.is_finished]
        for rid in gone:
            del self.sent[rid]
        step = StepInput([self._update(seq) for seq in batch.seqs], list(batch.num_tokens), batch.is_prefill,
                         self.row_changes, gone, launch, device_ids)
        self.row_changes = []
        return step

    def _update(self, seq: Sequence) -> RequestUpdate:
        s = self.sent.get(seq.request_id)
        first = s is None or s.seq is not seq
        if first:
            s = self.sent[seq.request_id] = _Sent(seq, 0, [], False)
        out = seq.output_token_ids
        pending = 0
        while pending < len(out) and out[-1 - pending] == PENDING:
            pending += 1
        known, prompt = seq.num_tokens - pending, len(seq.prompt_token_ids)
        # Past the prompt, the new tokens come from the output alone: `token_ids` copies the context.
        new = seq.token_ids[s.num_tokens:known] if s.num_tokens < prompt else \
            out[s.num_tokens - prompt:known - prompt]
        u = RequestUpdate(seq.request_id, new, pending, seq.num_cached_tokens, seq.convert_early,
                          seq.sparse is not None,
                          draft=seq.sparse.draft if seq.sparse is not None else None,
                          row=seq.sparse.row if seq.sparse is not None else None)
        if first:
            u.params = replace(seq.params, logits_processors=[])
            u.num_prompt_tokens = len(seq.prompt_token_ids)
        if seq.pages != s.pages:
            u.pages = s.pages = list(seq.pages)
        if seq.host_extent is not None and not s.has_extent:
            u.host_extent, s.has_extent = seq.host_extent, True
        s.num_tokens = known
        return u


class RequestMirror:
    """A rank other than 0: its copy of every request that has run, kept up by each StepInput."""

    def __init__(self, runner):
        self.runner = runner
        self.seqs: dict[str, Sequence] = {}

    def apply(self, step: StepInput) -> ScheduledBatch:
        """Conversions and pipeline leaves first, in rank 0's order (a conversion reads the state
        of the step that decided it), then the finished requests (their host extents go back
        before new ones are placed, as on rank 0), then the batch's changes."""
        r = self.runner
        recorded = {id(seq): q for seq, q in r.take_conversions()}
        for c in step.row_changes:
            seq = self.seqs[c.request_id]
            if isinstance(c, LeavePipeline):
                r.sparse.leave_pipeline(seq)
                continue
            if id(seq) not in recorded:
                raise RuntimeError(f"request {c.request_id!r} converted on rank 0 but recorded no query here")
            seq.num_cached_tokens, seq.pages = c.num_cached_tokens, list(c.dense_pages)
            r.convert_to_sparse(seq, recorded[id(seq)], c.working_set_pages, c.summary_run)
            seq.pages = list(c.working_set_pages) + list(c.summary_run)
        for rid in step.finished:
            seq = self.seqs.pop(rid)
            if r.sparse is not None:
                r.sparse.release(seq)
        return ScheduledBatch([self._update(u) for u in step.requests], step.num_tokens, step.is_prefill)

    def _update(self, u: RequestUpdate) -> Sequence:
        seq = self.seqs.get(u.request_id)
        if seq is None:
            prompt, out = u.new_tokens[:u.num_prompt_tokens], u.new_tokens[u.num_prompt_tokens:]
            seq = self.seqs[u.request_id] = Sequence(u.request_id, prompt, u.params, output_token_ids=out)
        else:
            out = seq.output_token_ids
            while out and out[-1] == PENDING:  # known now: among the new tokens
                out.pop()
            out.extend(u.new_tokens)
        seq.output_token_ids.extend([PENDING] * u.pending)
        seq.num_cached_tokens, seq.convert_early = u.num_cached_tokens, u.convert_early
        if u.pages is not None:
            seq.pages = u.pages
        if u.host_extent is not None:
            self._place_extent(seq, u.host_extent)
        if not u.sparse and seq.sparse is not None:  # preempted: recomputed dense, converted again
            self.runner.sparse.leave_pipeline(seq)
            seq.sparse = None
        if seq.sparse is not None:
            seq.sparse.draft = u.draft
            if seq.sparse.row != u.row:
                raise RuntimeError(f"request {seq.request_id!r}: pipeline row {seq.sparse.row} on this rank, "
                                   f"{u.row} on rank 0")
        return seq

    def _place_extent(self, seq: Sequence, ext: HostExtent) -> None:
        """The same extent in this rank's host pool: every rank's pool has the same layout and
        sees the same allocations and frees in the same order, so first-fit lands on the same
        start."""
        mine = self.runner.sparse.host.allocate(seq.request_id, ext.num_layers, ext.max_blocks, ext.num_kv_heads)
        if mine is None or mine.start != ext.start:
            raise RuntimeError(f"request {seq.request_id!r}: host extent at {mine and mine.start} on this rank, "
                               f"{ext.start} on rank 0")
        seq.host_extent = mine
