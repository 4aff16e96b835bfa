"""The decode instance's side of disaggregation (docs/disaggregation.md): admitting a request
from its prefill's admission, and the source the sparse manager asks for a disaggregated
working set's blocks (`SparseManager.remote`) around the pipeline's steps.

Each step's predictions mask the blocks the device map (`RemoteRows`) does not hold, so the
working set keeps what it holds, and list them; after the step the host asks for them
(`after_pipeline_step`: one read per prefill peer, under the byte budget), and before the next
it writes the items that arrived into the map (`before_pipeline_step`). With `strict`, each
layer of a step run in order waits for its blocks instead (`read_layer`): the working set
evolves exactly as it does colocated, which makes the tokens equal (tests).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from oasiskv.disagg.admission import Admission, admit_full, admit_rpf, held_positions
from oasiskv.disagg.full_transfer import FullTransfer
from oasiskv.disagg.remote_reads import HostArenaFull, RemoteReads
from oasiskv.engine.sequence import Sequence, SequenceStatus
from oasiskv.kernels.summary_fold import to_summary
from oasiskv.sampling_params import SamplingParams
from oasiskv.sparse.drafters import TokenHistory
from oasiskv.sparse.working_set import WorkingSet

# How a request whose prefill peer failed ends (the server answers it with 502).
PREFILL_FAILED = "the prefill instance holding this request's KV failed"
ARENA_FULL = "the decode server's host arena (--remote-kv-gb) has no room for the blocks this request completes"


class RemoteSource:
    """`SparseManager.remote` on a decode instance."""

    def __init__(self, reads: RemoteReads, num_layers: int, strict: bool = False,
                 budget_bytes: int | None = None):
        """strict: every layer of a step waits for its missing blocks (`read_layer`); budget_bytes:
        the reads posted after a step, at most (None: no budget)."""
        self.reads, self.num_layers, self.strict, self.budget_bytes = reads, num_layers, strict, budget_bytes

    @property
    def items(self) -> torch.Tensor:
        return self.reads.store.items

    def release(self, ws: WorkingSet) -> None:
        self.reads.release(ws.remote)

    # ---- around a pipeline step ---------------------------------------------------------
    def before_pipeline_step(self, pipeline, seqs: list[Sequence]) -> None:
        """Reads that settled, and local items for every block the step completes (its
        write-through goes there: `copy_mapped`), into the device map, on the step's stream.
        Strict: every layer of the step reads its missing blocks before its selection."""
        self.reads.poll()
        if self.strict:  # every predicted block that is not local is read (no per-head limit)
            pipeline.layer_reads, pipeline.remote.want_per_head = self.read_layer, 0
        bs, H = pipeline.bs, pipeline.H
        for s in seqs:
            req, n = s.sparse.remote, s.num_tokens - 1  # the step adds the token at position n
            if req is None or (n + 1) % bs or req.error is not None or req.released:
                continue
            if self.reads.place(req, np.arange(self.num_layers)[:, None], n // bs, np.arange(H)[None, :]) is None:
                # its write-through skips unmapped items; it ends after the step
                self.reads.fail_request(req, HostArenaFull(req.peer, ARENA_FULL))
        self.map_arrived(pipeline)

    def map_arrived(self, pipeline) -> None:
        """Items that became local since the last call, into the pipeline's device map."""
        parts = []
        for row, ws in enumerate(pipeline.owners):
            req = ws.remote
            if req is None or req.arrived is None:
                continue
            flat = req.take_arrived()
            if len(flat):
                layer, block, head = np.unravel_index(flat, req.where.shape)
                slot = np.full(len(flat), pipeline.remote.row_slots[row])
                parts.append((slot, layer, block, head, req.where.reshape(-1)[flat]))
        if parts:
            pipeline.remote.update_map(*(np.concatenate(x) for x in zip(*parts)))

    def read_layer(self, pipeline, layer: int) -> bool:
        """Strict (`LookaheadPipeline.layer_reads`, steps in order): layer l's predicted blocks
        that are not local are read now and waited for, then mapped, so the working set evolves
        as it does colocated. Returns whether any was missing (the layer is predicted again)."""
        self.reads.poll()
        H = pipeline.H
        wanted = pipeline.remote.wanted[:pipeline.B * H, layer].cpu().numpy()  # [rows * Hkv, K]
        line, k = np.nonzero(wanted >= 0)
        if not len(line):
            return False
        row = line // H
        for r in np.unique(row):
            at = row == r
            self.reads.want(pipeline.owners[r].remote, layer, wanted[line[at], k[at]], line[at] % H)
        self.reads.flush()
        self.reads.wait()
        self.map_arrived(pipeline)
        return True

    def after_pipeline_step(self, pipeline) -> None:
        """The step's wanted blocks (read with its tokens) asked for, one call per row (the
        flush takes them layer by layer), and posted: one read per
        peer, under the byte budget. Rows whose peer has a read in flight ask nothing (none
        would be posted), and when that is every row the step's wanted are not even read."""
        self.reads.poll()
        busy = self.reads.busy_peers()  # they get no read this step: skip their rows' asks
        rows = [ws.remote for ws in pipeline.owners]
        if not any(req is not None and req.peer not in busy for req in rows):
            return
        layer, row, head, block = pipeline.remote.read_wanted()  # row by row
        for seg in np.split(np.arange(len(row)), np.flatnonzero(np.diff(row)) + 1) if len(row) else []:
            req = rows[row[seg[0]]]
            if req is not None and req.peer not in busy:
                self.reads.want(req, layer[seg], block[seg], head[seg])
        self.reads.flush(self.budget_bytes)


def request_max_blocks(engine, adm: Admission, params: SamplingParams) -> int:
    """Blocks per layer the decode side holds for the admission (prompt and generated tokens)."""
    seq = Sequence(adm.request_id, list(adm.prompt_token_ids), params, output_token_ids=[adm.first_token])
    seq.num_cached_tokens = adm.num_cached
    return engine.runner.sparse.max_blocks(seq, engine.max_model_len)


def admit(engine, adm: Admission, peer: str, params: SamplingParams,
          transfer: FullTransfer | None = None) -> Sequence | None:
    """Start decoding an admission in `engine` (a decode instance whose sparse manager has a
    RemoteSource): its working set on the GPU, its summaries, its draft chain and first token,
    as the prefill's conversion left them; `rpf` reads the other blocks from `peer` when asked,
    `full` holds them all: read by `transfer` (done), or here, before it starts, when none is
    given. None if pages or host items are short now."""
    m = engine.runner.sparse
    source: RemoteSource = m.remote
    P = m.cfg.working_set_blocks
    seq = Sequence(adm.request_id, list(adm.prompt_token_ids), params, output_token_ids=[adm.first_token])
    seq.num_cached_tokens = adm.num_cached
    max_blocks = m.max_blocks(seq, engine.max_model_len)
    own = adm.mode == "full" and transfer is None
    if own:
        transfer = FullTransfer.start(source.reads, adm, peer, max_blocks)
        if transfer is None:
            return None
        transfer.wait()

    def short() -> None:  # nothing admitted: what was taken goes back
        if own:
            transfer.abandon()
        return None

    bm = engine.block_manager
    pages = bm.take(P)
    if pages is None:
        return short()
    run = bm.take_run(m.arena.pages_for(max_blocks))  # its summaries' pages
    if run is None:
        bm.give_back(pages)
        return short()
    pages_held = pages + run
    if adm.mode == "full":
        if not transfer.done:
            raise ValueError("a full admission is placed once its transfer is done")
        state = admit_full(adm, transfer.remote, source.reads, m.summary_dtype)
    else:
        state = admit_rpf(adm, source.reads, peer, max_blocks)
    if state is None:
        bm.give_back(pages_held)
        return None
    p = m.pipeline
    slot = None
    if p is not None:  # its row of the batched pipeline, and that row's item map
        if p.remote is None:
            raise ValueError("the engine's pipeline has no rows for disaggregated requests (remote_kv_gb)")
        slot = p.remote.take_slot() if p.num_rows < p.R else None
        if slot is None:  # every row in use: it waits (a full transfer keeps what it read)
            bm.give_back(pages_held)
            if adm.mode == "rpf":
                source.reads.release(state.remote)
            return short()
    if adm.mode == "full":  # admit_rpf tracks its own
        source.reads.admit(state.remote)
    # LRU stamps are steps: keep their distance to the prefill's step (never below zero).
    m.step = max(m.step, adm.step)
    last = state.last_selected
    last = torch.where(last >= 0, last + (m.step - adm.step), last)
    # The prefill side's summaries in this side's dtype (the min rounded down, the max up).
    kmin = to_summary(state.kmin.to(m.device), m.summary_dtype, toward=-1)
    kmax = to_summary(state.kmax.to(m.device), m.summary_dtype, toward=+1)
    ws = WorkingSet(m.cfg, pages, None, state.blocks, last, None, None, draft=adm.draft, remote=state.remote)
    m.place_summaries(ws, kmin, kmax, run)
    ws.history = TokenHistory(seq.token_ids)
    layer, head, pos = held_positions(state.blocks)
    slots = torch.tensor(pages, dtype=torch.long)[pos] * m.Hkv + head
    m.kv[layer.to(m.device), slots.to(m.device)] = state.items.to(m.device, m.kv.dtype)
    if p is not None:
        source.reads.mapped(state.remote)  # from now on the map follows the table
        p.adopt(ws, seq.num_cached_tokens, slot)
        p.remote.set_map(slot, state.remote.where)
    seq.pages, seq.sparse, seq.status = pages_held, ws, SequenceStatus.RUNNING
    engine.seqs[seq.request_id] = seq
    engine.scheduler.running.append(seq)
    return seq


def fail_requests(engine, reads: RemoteReads) -> list:
    """End the requests whose prefill peer failed (`RemoteReads.failed`) with an error output
    each (finish reason "error"); their pages and items go back. Call after every step."""
    outputs = []
    failed, reads.failed = reads.failed, []
    for req in failed:
        seq = engine.seqs.get(req.request_id)
        if seq is None or seq.is_finished:
            continue
        seq.error = ARENA_FULL if isinstance(req.error, HostArenaFull) else f"{PREFILL_FAILED}: {req.error}"
        outputs.append(engine._fail(seq, time.perf_counter()))
    return outputs
