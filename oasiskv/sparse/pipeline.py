"""The lookahead prefetch pipeline (docs/design.md): the GPU-resident state of the
sparse requests of a decode batch, and per layer three stages that run in the background:

    predict   score every block from the summaries with the draft query, top-K per KV head
    select    capped eviction: which predicted blocks come in, which LRU blocks leave
    transfer  copy the admitted (layer, block, head) items host -> their GPU slots

The layer's qkv epilogue folds its keys into the summaries and copies the draft queries out
(`summary_fold`). After layer l's attention (or its o_proj GEMM, for long requests:
`stages_fork`) the foreground records an event and moves on; the predict stream waits on that
event, the select stream on predict's, the transfer stream on select's. Every stage is GPU
tensor work with fixed shapes (no host sync, no Python loop over blocks), so the whole step,
foreground and pipeline, is captured in one CUDA graph; the streams join the foreground at
the end of the step, and how long the foreground waits there is the pipeline stall. The last
layers' transfers are left out of that join: they open the next step, whose layer l waits on
its own (`begin_step`); so does the step's write-through of the blocks it completed.

State, for up to R requests ("rows"), all on the device:
    pages [R, P]            GPU pages of each row's working set; position i of head h is
                            slot pages[i] * Hkv + h: [0,S) sinks, [S,S+K) dynamic, then the
                            window ring (block b at S + K + b % W)
    resident, last [L, R*Hkv, K]   logical block of each dynamic slot, the step it was last
                            selected; rows r * Hkv + h
    kmin, kmax [L, NB, Hkv, D]     block summaries, row r's blocks from summary_offset[r]: views
                            of the page pool (`summary_arena`), a run of pages per row
    host extent of each row (start item, max blocks) for the transfer's addresses; a decode
                            instance's disaggregated rows have none: their items are where
                            `remote` (RemoteRows) maps them
    cached [R]              tokens in the cache before this step's token; active [R]
    history [R, 4096]       each row's newest tokens (right-aligned), for drafts chosen on the
                            device (`advance_drafts`)
The foreground of a step reads tables built from this state (`step_tables`), so a step
never needs the host to know which blocks are resident.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from oasiskv.kernels.capped_eviction import eviction_marks
from oasiskv.kernels.copy_items import device_view, fetch_admitted, write_through
from oasiskv.kernels.qkv_epilogue import SummaryFold
from oasiskv.kernels.step_clock import STAMPS, stamp
from oasiskv.kernels.step_tables import RowState, StepTables, WriteThrough, step_tables
from oasiskv.layers.attention import AttentionMetadata
from oasiskv.sparse import device_drafts
from oasiskv.sparse.block_scores import score_select
from oasiskv.sparse.capped_eviction import capped_eviction_
from oasiskv.sparse.config import SparseConfig
from oasiskv.sparse.drafters import LOOKUP_WINDOW, drafter_named
from oasiskv.sparse.fetch_budget import FetchBudget, measure_link, share_budget
from oasiskv.sparse.host_pool import HostExtent, HostKVPool
from oasiskv.sparse.remote_rows import RemoteRows
from oasiskv.sparse.summaries import summary_dtype
from oasiskv.sparse.summary_arena import SummaryArena
from oasiskv.sparse.tuning import PipelineTuning
from oasiskv.sparse.working_set import WorkingSet

# From this many blocks (16K tokens) a layer's bounds scan is long enough that its stages fork
# after o_proj (`stages_fork`); shorter requests keep the attention fork.
LONG_SCAN_BLOCKS = 1024
# The bounds kernel (the prediction's scan of the summaries): 64 blocks a tile, 3 load stages,
# and about 3 programs per (request, kv head) whatever the context.
BOUNDS_TILE, BOUNDS_STAGES, BOUNDS_PROGRAMS_PER_HEAD = 64, 3, 3
# The working-set attention's software-pipeline stages where an SM offers ~200 KB of shared
# memory (Hopper): 5 keeps two K/V tiles in flight (~137 KB a program at head_dim 128 in bf16).
WORKING_SET_STAGES, WORKING_SET_STAGES_SMEM = 5, 200 * 1024
DEFERRED_LAYERS = 2  # layers whose transfer crosses into the next step on side streams (`begin_step`)


def bounds_tiling(max_blocks: int, tile: int = BOUNDS_TILE, stages: int = BOUNDS_STAGES) -> tuple[int, int, int]:
    """(blocks per tile, tiles per program, stages) of the bounds kernel over `max_blocks`: the
    tiles per program that give each (request, kv head) about BOUNDS_PROGRAMS_PER_HEAD programs."""
    tiles = -(-max_blocks // tile)
    return tile, max(1, -(-tiles // BOUNDS_PROGRAMS_PER_HEAD)), stages


def scan_buckets(max_blocks: int, first: int) -> list[int]:
    """The widths a captured step's prediction may scan: `first` (`PipelineTuning.scan_bucket_blocks`),
    doubling, then `max_blocks`. A step is built per width, and runs with the narrowest that holds
    its longest request, so the scan's cost follows the batch's contexts rather than the model's length."""
    widths, b = [], first
    while b < max_blocks:
        widths.append(b)
        b *= 2
    return widths + [max_blocks]


def stages_fork(max_blocks: int, tuning: PipelineTuning) -> str:
    """The part of each layer after which a pipelined step's stages start, for requests of up
    to `max_blocks` blocks (the width of the bounds scan): the tuning's, or by the width."""
    if tuning.stages_fork is not None:
        return tuning.stages_fork
    return "o_proj" if max_blocks >= LONG_SCAN_BLOCKS else "attention"


def working_set_stages(device: torch.device, dtype: torch.dtype, head_dim: int,
                       tuning: PipelineTuning) -> int | None:
    """The tuning's stages, or WORKING_SET_STAGES where the device's SMs have the shared memory
    for them at this KV dtype and head size, else None (the decode kernel's default)."""
    if tuning.attention_stages is not None:
        return tuning.attention_stages
    if device.type != "cuda":
        return None
    smem = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    tile_scale = dtype.itemsize / 2 * head_dim / 128  # the tiles' bytes against bf16 at head_dim 128
    return WORKING_SET_STAGES if smem >= WORKING_SET_STAGES_SMEM * tile_scale else None


class LookaheadPipeline:
    def __init__(self, cfg: SparseConfig, model_config, kv: torch.Tensor, host: HostKVPool,
                 max_rows: int, max_blocks: int, block_size: int, tuning: PipelineTuning = PipelineTuning(), *,
                 remote: RemoteRows | None = None):
        """kv: [L, num_slots, 2, block_size, D], the engine's page pool; max_blocks: blocks of
        the longest request (the width of the score buffer, fixed per graph); tuning: grids,
        stages and streams (`sparse.tuning`); remote: a decode instance's mapped rows."""
        mc = model_config
        self.cfg, self.kv, self.host, self.bs, self.tuning = cfg, kv, host, block_size, tuning
        self.L, self.H, self.D, self.G = mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.group_size
        self.S, self.K, self.W = cfg.sink_blocks, cfg.top_k_blocks, cfg.window_blocks
        drafter = drafter_named(cfg.drafter)
        # Retrieval on demand (the `ondemand` baseline): each layer's stages run before its
        # attention, with the current token's query, for this step's blocks, on the critical
        # path, and admit every predicted block (no cap, no budget, nothing deferred).
        self.on_demand = drafter.retrieves_on_demand
        self.P, self.R = cfg.working_set_blocks, max_rows
        self.C = cfg.top_k_blocks if self.on_demand else cfg.fetch_cap
        self.B = max_rows  # rows a step runs over: the first B (a graph bucket); set per step
        self.owners: list[WorkingSet] = []  # the WorkingSet in each used row; used rows are 0 .. len-1
        self.max_blocks = max_blocks
        self.scan_blocks = max_blocks  # blocks the prediction scans per request (`set_scan`)
        self.drafted = drafter.sends_draft_token  # else the current token's query predicts
        self.remote = remote
        # Strict remote reads (a decode instance's `RemoteSource.read_layer`, steps in order):
        # after a layer's prediction masked blocks that are not local, it reads them and waits.
        self.layer_reads: Callable[[LookaheadPipeline, int], bool] | None = None
        # Read-only callbacks (pipeline, layer, the step's queries [2B, Hq, D]) after each layer's
        # stages, in steps run in order: evaluations record predictions through them
        # (oasiskv.eval.lookahead_recorder) without touching the step.
        self.observers: list[Callable[[LookaheadPipeline, int, torch.Tensor], None]] = []
        self.max_position = 0  # the model's, set by each step's tables
        self.bounds_tiling = bounds_tiling(max_blocks)  # blocks per tile, tiles per program, stages
        self.stages_fork = stages_fork(max_blocks, tuning)  # the part of a layer after which its stages start
        dev = self.device = kv.device
        # The decode kernel's pipeline stages; None: its default.
        self.attention_stages = working_set_stages(dev, kv.dtype, self.D, tuning)
        L, R, H, K = self.L, self.R, self.H, self.K
        i32 = dict(dtype=torch.int32, device=dev)
        self.pages = torch.zeros(R, self.P, **i32)
        self.resident = torch.full((L, R * H, K), -1, **i32)
        self.last = torch.full((L, R * H, K), -1, **i32)
        self.arena = SummaryArena(kv, H, summary_dtype(cfg.summary_dtype, kv.dtype, dev))
        self.kmin, self.kmax = self.arena.kmin, self.arena.kmax
        self.summary_offset = torch.zeros(R, dtype=torch.long, device=dev)
        self.extent_start = torch.zeros(R, dtype=torch.long, device=dev)
        self.extent_blocks = torch.zeros(R, dtype=torch.long, device=dev)
        self.cached = torch.zeros(R, **i32)
        self.active = torch.zeros(R, dtype=torch.bool, device=dev)
        self.step = torch.zeros((), **i32)
        self.history = torch.full((R, LOOKUP_WINDOW), -1, dtype=torch.long, device=dev)
        self.history_len = torch.zeros(R, dtype=torch.long, device=dev)
        self.stats = torch.zeros(R * H, 4, dtype=torch.long, device=dev)  # hits, missed, admitted, evicted
        # Per-step values every stage reads, computed once at the start of the step.
        self.next_blocks = torch.zeros(R, dtype=torch.long, device=dev)  # blocks at the next step
        self.next_window = torch.zeros(R, dtype=torch.long, device=dev)  # its first window block
        self.completes = torch.zeros(R, dtype=torch.bool, device=dev)  # this token fills its block
        self.window_slot = torch.zeros(R, dtype=torch.long, device=dev)  # head 0's slot of that block
        self.block = torch.zeros(R, dtype=torch.long, device=dev)  # the block this token goes to
        self.summary_block = torch.zeros(R, dtype=torch.long, device=dev)  # its summary row, -1 inactive
        self.first_in_block = torch.zeros(R, dtype=torch.bool, device=dev)
        # Per-layer hand-off buffers between stages: they outlive the step, so no stream ever
        # reads memory the allocator has given to another.
        self.draft_q = torch.zeros(L, R, mc.num_heads, self.D, dtype=kv.dtype, device=dev)
        self.predicted = torch.full((L, R * H, K), -1, **i32)  # the top-K as a set (any order)...
        self.predicted_scores = torch.full((L, R * H, K), float("-inf"), device=dev)  # ...and its scores
        self.admit_blocks = torch.full((L, R * H, self.C), -1, **i32)
        self.admit_slots = torch.full((L, R * H, self.C), -1, **i32)
        # The transfer budget (`fetch_budget`): what each row would admit, and its share; one
        # layer at a time on the select stream, so one set of buffers serves every layer.
        self.budget = FetchBudget("off" if self.on_demand else cfg.fetch_budget, self.item_bytes, L)
        self.cand_rank = torch.zeros(R * H, self.C, **i32)
        self.cand_score = torch.zeros(R * H, self.C, dtype=torch.float32, device=dev)
        self.row_cap = torch.zeros(R * H, **i32)
        self.budget_items = torch.full((), R * H * self.C, dtype=torch.long, device=dev)  # per layer
        # Per step, read back with the step's tokens: device clock stamps (start, foreground
        # done, joined; `step_clock`) and the (hits, missed, admitted, evicted) of every row.
        self.clock = torch.zeros(STAMPS, dtype=torch.long, device=dev)
        self.step_totals = torch.zeros(4, dtype=torch.long, device=dev)
        self.eviction_marks = eviction_marks(R * H, max_blocks, dev)  # the select's scratch, every layer's
        self.host_items = device_view(host.items, dev) if dev.type == "cuda" else host.items
        self.background = dev.type == "cuda" if tuning.background is None else tuning.background
        if self.background:  # predict, select, transfer (graph nodes keep their stream's priority)
            self.streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev),
                            torch.cuda.Stream(dev, priority=tuning.transfer_priority)]
        self.timing = None  # PipelineTiming when step timing is on
        if self.budget.setting == "auto" and dev.type == "cuda":
            self.budget.link_bytes_per_s = self.measure_link()
        self.set_budget()
        self.stages = tuning.stages  # < 3: only the first stages run: benchmarks only
        self.prefetch = self.stages > 0  # False: summaries only (the foreground's own cost)
        # The last `deferred_layers` layers' transfers start the next step instead of ending this
        # one, and that step's layer l waits for its own (an event): the step's end then waits
        # only on the transfers that had the step's slack (docs/design.md, the sparse decode step).
        # By default on side streams only (in order, on CPU, nothing waits: tests may set it there).
        deferred = tuning.deferred_layers
        self.deferred_layers = min(L, (DEFERRED_LAYERS if self.background else 0) if deferred is None else deferred)
        if self.on_demand:
            self.deferred_layers = 0
        self.deferred_done = [torch.cuda.Event() for _ in range(L)] if self.background else []
        # The last step's write-through, kept by the step tables for the step after (deferred).
        self.last_write = WriteThrough(torch.zeros(R, dtype=torch.bool, device=dev),
                                       torch.zeros(R, dtype=torch.long, device=dev),
                                       torch.zeros(R, dtype=torch.long, device=dev))

    def state_bytes(self) -> int:
        """Device bytes of the rows' state (tables, hand-off buffers, a decode instance's item
        maps): every device tensor it holds but the page pool and views of host memory."""
        foreign = {self.kv.untyped_storage().data_ptr(), self.host.items.data_ptr()}
        if self.remote is not None:
            foreign.add(self.remote.items.data_ptr())
        seen: set[int] = set()

        def walk(x) -> int:
            if isinstance(x, (list, tuple)):
                return sum(walk(y) for y in x)
            if not isinstance(x, torch.Tensor) or x.device != self.device:
                return 0
            storage = x.untyped_storage()
            if storage.data_ptr() in foreign or storage.data_ptr() in seen:
                return 0
            seen.add(storage.data_ptr())
            return storage.nbytes()
        owners = [self] + ([self.remote] if self.remote is not None else [])
        return sum(walk(v) for o in owners for v in vars(o).values())

    @property
    def scan_widths(self) -> list[int]:
        """The prediction widths a step is built for (`scan_buckets`)."""
        return scan_buckets(self.max_blocks, self.tuning.scan_bucket_blocks)

    def set_scan(self, blocks: int) -> None:
        """The steps built from now on scan `blocks` blocks per request (every request of the
        step must have at most that many); the bounds kernel's tiling and the fork follow."""
        self.scan_blocks = blocks
        self.bounds_tiling = bounds_tiling(blocks)
        self.stages_fork = stages_fork(blocks, self.tuning)

    # ---- the transfer budget ---------------------------------------------------------
    def set_budget(self) -> None:
        """Write the budget's current value where the select stage reads it (between steps)."""
        items = self.budget.items_per_layer if self.budget.enabled else self.R * self.H * self.C
        if items != getattr(self, "_budget_written", None):
            self.budget_items.fill_(items)
            self._budget_written = items

    def measure_link(self, max_items: int = 16384) -> float:
        """Host -> GPU bytes per second of the transfer kernel as the step launches it (its
        programs, items in flight and warps), over distinct host items into a scratch pool."""
        H, C, S = self.H, self.C, self.S
        rows = max(1, min(max_items, self.host.num_items) // (H * C))
        dev = self.device
        pages = torch.arange(rows * (S + C), device=dev, dtype=torch.int32).view(rows, S + C)
        scratch = torch.empty(rows * (S + C) * H, *self.kv.shape[2:], dtype=self.kv.dtype, device=dev)
        blocks = torch.arange(C, device=dev, dtype=torch.int32).expand(rows * H, C).contiguous()
        start = torch.arange(rows, device=dev) * (C * H)
        nblk = torch.full((rows,), C, dtype=torch.long, device=dev)
        t = self.tuning
        fetch = lambda: fetch_admitted(self.host_items, scratch, 0, blocks, blocks, pages, start, nblk, H, S,  # noqa: E731
                                       t.transfer_programs, t.transfer_items, t.transfer_warps)
        return measure_link(fetch, rows * H * C * self.item_bytes)

    def read_step(self, values: list[int]) -> dict:
        """A step's clock stamps and counters as the host read them back (`step_readout`): its
        foreground and stall (seconds), items moved and the budget it ran under; the budget's
        running foreground time takes the step in."""
        start, fg_done, joined, hits, missed, admitted, _ = values
        fg, stall = max(0, fg_done - start) / 1e9, max(0, joined - fg_done) / 1e9
        budget = self._budget_written * self.L * self.item_bytes
        if fg > 0:
            self.budget.observe(fg, stall)
            self.set_budget()
        return {"foreground_s": fg, "stall_s": stall, "bytes": admitted * self.item_bytes,
                "budget_bytes": budget if self.budget.enabled else 0, "hits": hits,
                "predicted": hits + missed}

    def start_clock(self) -> None:
        """Start of a step (inside the graph): its counters zeroed, its first stamp."""
        self.step_totals.zero_()
        stamp(self.clock, 0)

    def step_readout(self) -> torch.Tensor:
        """What `read_step` reads, as one device tensor to copy with the step's tokens."""
        return torch.cat([self.clock, self.step_totals])

    # ---- rows ----------------------------------------------------------------------
    def bind(self, row: int, pages: list[int], extent: HostExtent | None, summary_offset: int,
             remote_slot: int = -1) -> None:
        """Give row `row` its working-set pages, host extent and summary range (or, a
        disaggregated row: no extent, its `remote` slot). The caller then fills resident /
        summaries / host items (conversion) and sets cached and active."""
        assert len(pages) == self.P and (extent is None) == (remote_slot >= 0)
        assert extent is None or (extent.num_kv_heads == self.H and extent.num_layers == self.L)
        self.pages[row] = torch.tensor(pages, dtype=torch.int32)
        self.extent_start[row] = 0 if extent is None else extent.start
        self.extent_blocks[row] = 0 if extent is None else extent.max_blocks  # 0: the extent forms skip it
        self.summary_offset[row] = summary_offset
        if self.remote is not None:
            self.remote.set_row(row, remote_slot)
        rows = slice(row * self.H, (row + 1) * self.H)
        self.resident[:, rows] = -1
        self.last[:, rows] = -1
        self.stats[rows] = 0

    @property
    def num_rows(self) -> int:
        return len(self.owners)

    def adopt(self, ws: WorkingSet, cached: int, remote_slot: int = -1) -> None:
        """Take a just-converted request (its WorkingSet as `SparseManager.convert` built it) into
        the next free row: its working set and LRU stamps move to the batched state; its
        summaries are in the page pool already (`SparseManager.place_summaries`). A
        disaggregated request (no extent) comes with its `remote` slot; the caller maps its
        items (`RemoteRows.set_map`)."""
        row = len(self.owners)
        if row >= self.R:
            raise RuntimeError(f"more than {self.R} sparse requests at once")
        self.flush_deferred()
        ext, S, K, H = ws.extent, self.S, self.K, self.H
        self.bind(row, ws.pages, None if remote_slot >= 0 else ext, ws.summary_offset, remote_slot)
        rows = slice(row * H, (row + 1) * H)
        self.resident[:, rows] = ws.blocks[:, :, S:S + K].to(self.device)
        # Conversion stamped its blocks with the manager's step; restamp them with ours.
        self.last[:, rows] = torch.where(ws.last_selected.to(self.device) >= 0, self.step, -1).int()
        self.cached[row] = cached
        self.active[row] = False
        tail = torch.from_numpy(ws.history.tail(LOOKUP_WINDOW).copy())
        self.history[row] = -1
        self.history[row, LOOKUP_WINDOW - len(tail):] = tail.to(self.device)
        self.history_len[row] = len(tail)
        ws.blocks = ws.last_selected = ws.kmin = ws.kmax = None  # the pipeline holds them now
        ws.row = row
        self.owners.append(ws)

    def working_set_of(self, ws: WorkingSet, adding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's working set as `SparseManager.convert` lays it out, on the host (a sync):
        blocks [L, Hkv, P] (sinks, the dynamic blocks, the window ring; -1 empty) and the dynamic
        blocks' selection stamps [L, Hkv, K] (this pipeline's steps). What a hand-over sends.
        adding: inside a step, whose token's block counts as held."""
        row, H, S, K = ws.row, self.H, self.S, self.K
        n = int(self.cached[row])
        rows = slice(row * H, (row + 1) * H)
        blocks = torch.full((self.L, H, self.P), -1, dtype=torch.int32)
        blocks[:, :, S:S + K] = self.resident[:, rows].cpu()
        held = n // self.bs + 1 if adding else -(-n // self.bs)  # blocks with a token
        for b in [*range(min(S, held)), *range(ws.window_start(n, self.bs), held)]:
            blocks[:, :, ws.position(b)] = b
        return blocks, self.last[:, rows].long().cpu()

    def release(self, ws: WorkingSet) -> list[int]:
        """Free the request's row; the last used row moves into it, so used rows stay a prefix.
        Returns the row's counters (hits, missed, admitted, evicted) summed over heads (a sync:
        after it no kernel reads or writes the row's items, so a disaggregated row's may go)."""
        self.flush_deferred()  # plans are per row: land them before rows move
        row, last, H = ws.row, len(self.owners) - 1, self.H
        counts = self.stats[row * H:(row + 1) * H].sum(0).tolist()
        if self.remote is not None and self.remote.row_slots[row] >= 0:
            self.remote.free_slot(self.remote.row_slots[row])
            self.remote.set_row(row, -1)
        if row != last:
            src, dst = slice(last * H, (last + 1) * H), slice(row * H, (row + 1) * H)
            for t in (self.resident, self.last):
                t[:, dst] = t[:, src]
            self.stats[dst] = self.stats[src]
            for t in (self.pages, self.summary_offset, self.extent_start, self.extent_blocks, self.cached,
                      self.history, self.history_len):
                t[row] = t[last]
            if self.remote is not None:
                self.remote.move_row(last, row)
            moved = self.owners[last]
            moved.row = row
            self.owners[row] = moved
        self.active[last] = False
        self.owners.pop()
        ws.row = None
        return counts

    def advance_drafts(self, drafter: str, rows: torch.Tensor, drafts: torch.Tensor, tokens: torch.Tensor,
                       guesses: torch.Tensor) -> torch.Tensor:
        """After a step: each row's history takes its new token, and the next drafts [n] are
        chosen on the device (`device_drafts.next_drafts`); rows, drafts (the ones the step ran
        with), tokens, guesses: [n], in the caller's order."""
        window, lengths = device_drafts.append(self.history, self.history_len, tokens, rows)
        return device_drafts.next_drafts(drafter, window, lengths, drafts, tokens, guesses)

    # ---- the foreground's tables, from the state alone ---------------------------------
    def step_tables(self, max_position: int) -> StepTables:
        """For the step that adds token number cached[r] to each of the first B rows: slot
        tables [L, B, H, P] (valid slots first: sinks, dynamic, full window blocks oldest
        first, the partial block last, as the decode kernel walks them), cached-token counts,
        where the token's K/V goes and the positions of the token and its draft
        (`kernels.step_tables`); the values the stages read later go to their buffers."""
        B = self.B
        rows = RowState(self.next_blocks[:B], self.next_window[:B], self.completes[:B], self.window_slot[:B],
                        self.block[:B], self.summary_block[:B], self.first_in_block[:B])
        last = WriteThrough(*(t[:B] for t in self.last_write)) if self.defers_write_through else None
        tables = step_tables(self.cached[:B], self.active[:B], self.pages[:B], self.resident, self.summary_offset[:B],
                             self.H, self.S, self.W, self.bs, max_position, rows, last)
        if self.on_demand:  # the stages predict this step's blocks, not the next step's
            cur = self.cached[:B].long() // self.bs
            self.next_blocks[:B] = torch.where(self.active[:B], cur + 1, 0)
            self.next_window[:B] = (cur - self.W + 1).clamp_min(self.S)
        self.max_position = max_position
        return tables

    def layer_tables(self, layer: int, meta: AttentionMetadata) -> None:
        """Layer l's slot tables and cached-token counts in `meta`, rebuilt from the state (after
        an on-demand retrieval changed the layer's working set, before its attention reads them)."""
        B = self.B
        scratch = RowState(*(torch.empty_like(t[:B]) for t in (self.next_blocks, self.next_window, self.completes,
                                                               self.window_slot, self.block, self.summary_block,
                                                               self.first_in_block)))
        t = step_tables(self.cached[:B], self.active[:B], self.pages[:B], self.resident[layer:layer + 1],
                        self.summary_offset[:B], self.H, self.S, self.W, self.bs, self.max_position, scratch)
        meta.slot_tables[layer].copy_(t.slot_tables[0])
        meta.cache_lens[layer].copy_(t.cache_lens[0])

    # ---- hooks called by the attention layer ----------------------------------------
    def summary_fold(self, layer: int) -> SummaryFold:
        """For the layer's qkv epilogue: each row's token key into its block's summary, and the
        draft query (the token's own with `prev`) copied out in the same launch: the stages
        read it later, from another stream, after the foreground has moved on."""
        B = self.B
        return SummaryFold(self.kmin[layer], self.kmax[layer], self.summary_block[:B], self.first_in_block[:B],
                           query_len=2, draft_to=self.draft_q[layer, :B] if self.prefetch else None,
                           draft_index=1 if self.drafted else 0)

    def begin_step(self) -> None:
        """Start of a step, after its tables and before its layers: the last step's
        write-through and the transfers it deferred go first on the transfer stream, each
        transfer recording the event its layer waits on (`before_attention`)."""
        deferred = self.deferred_range()
        if not deferred:
            return
        on_stream = contextlib.nullcontext()  # in order (CPU): the same work, one step later
        if self.background:
            transfer = self.streams[2]
            transfer.wait_stream(torch.cuda.current_stream(self.device))
            on_stream = torch.cuda.stream(transfer)
        with on_stream:
            if self.defers_write_through:
                self.write_through(self.last_write)
            for layer in deferred:
                self.transfer(layer)
                if self.background:
                    self.deferred_done[layer].record()
                if self.timing is not None:
                    self.timing.layer_done[layer].record()

    def deferred_range(self) -> range:
        """The layers whose transfer opens the next step (none unless the transfer stage runs)."""
        n = self.deferred_layers if self.prefetch and self.stages >= 3 else 0
        return range(self.L - n, self.L)

    @property
    def defers_write_through(self) -> bool:
        """With transfers deferred, a step's write-through opens the next step too, so the
        step's end waits for none of it. The completed block stays in the window ring for
        W - 1 more blocks: with W >= 2 no token overwrites its slot and no fetch reads its host
        copy before then (a fetch would come later on the same transfer stream anyway)."""
        return bool(self.deferred_range()) and self.W >= 2

    def flush_deferred(self) -> None:
        """Land the deferred transfers now and drop their plans (rows are about to change): the
        next step's `begin_step` then moves nothing for them."""
        deferred = self.deferred_range()
        if not deferred:
            return
        for layer in deferred:
            self.transfer(layer)
        self.admit_blocks[deferred.start:] = -1
        if self.defers_write_through:  # the last step's, which the next step would have done
            self.write_through()
            self.completes.fill_(False)

    def before_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata) -> None:
        if self.on_demand:
            if self.prefetch:  # on the foreground, before the attention reads the layer's tables
                self.predict(layer)
                self.select(layer)
                self.transfer(layer)
                self.layer_tables(layer, meta)
            return
        if self.background and layer in self.deferred_range():
            torch.cuda.current_stream(self.device).wait_event(self.deferred_done[layer])
        self.fork_point(layer, "epilogue")

    def after_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata) -> None:
        """The layer's epilogue has folded its keys and copied the draft queries out
        (`summary_fold`): the stages can start (here, in order, without side streams)."""
        if not self.prefetch or self.on_demand:
            return
        if not self.background:
            self.predict(layer)
            if self.stages >= 2:
                self.select(layer)
            if self.stages >= 3 and layer not in self.deferred_range():
                self.transfer(layer)
            for observe in self.observers:
                observe(self, layer, q)
        self.fork_point(layer, "attention")  # side streams: the stages start here or later

    def fork_point(self, layer: int, part: str) -> None:
        """The foreground has launched `part` of layer l (epilogue, attention, o_proj, mlp): at the
        `stages_fork` part, layer l's stages start on the side streams."""
        if not (self.background and self.prefetch) or self.on_demand:
            return
        early = self.stages_fork == "epilogue"
        if part == self.stages_fork:
            predict, select, _ = self.streams
            predict.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(predict):
                self.predict(layer)
            select.wait_stream(predict)
            with torch.cuda.stream(select):
                if self.stages >= 2:
                    self.select(layer)
            if not early:
                self._launch_transfer(layer)
        elif early and part == "attention":  # the attention has read its slots: they may change
            self._launch_transfer(layer)

    def _launch_transfer(self, layer: int) -> None:
        """Layer l's transfer on its stream, after its selection and after everything the
        foreground has launched so far."""
        if layer in self.deferred_range():
            return  # its transfer opens the next step (`begin_step`)
        _, select, transfer = self.streams
        transfer.wait_stream(select)
        transfer.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(transfer):
            if self.stages >= 3:
                self.transfer(layer)
            if self.timing is not None:
                self.timing.layer_done[layer].record()

    def join(self) -> None:
        """End of the step: a block this step completed goes to the host (write-through, so
        the host pool holds every finished block; deferred: at the next step's start), and the
        foreground waits for every stage (the pipeline stall)."""
        if not (self.background and self.prefetch):
            if not self.defers_write_through:
                self.write_through()
            stamp(self.clock, 1)
            stamp(self.clock, 2)
            return
        if not self.defers_write_through:
            transfer = self.streams[2]
            transfer.wait_stream(torch.cuda.current_stream(self.device))  # every layer stored its token
            with torch.cuda.stream(transfer):
                self.write_through()
        fg = torch.cuda.current_stream(self.device)
        if self.timing is not None:
            self.timing.foreground_done.record()
        stamp(self.clock, 1)
        for s in self.streams:
            fg.wait_stream(s)
        stamp(self.clock, 2)
        if self.timing is not None:
            self.timing.joined.record()

    # ---- the stages ----------------------------------------------------------------
    def predict(self, layer: int, read: bool = True) -> None:
        B, H = self.B, self.H
        score_select(self.draft_q[layer, :B], self.kmin[layer], self.kmax[layer], self.summary_offset[:B],
                     self.next_blocks[:B], self.G, self.K, max_blocks=self.scan_blocks, num_sink=self.S,
                     window_start=self.next_window[:B],
                     out=(self.predicted[layer, :B * H], self.predicted_scores[layer, :B * H]),
                     block_tile=self.bounds_tiling[0], tiles_per_program=self.bounds_tiling[1],
                     stages=self.bounds_tiling[2])
        if self.remote is not None:  # disaggregated rows: only local blocks may come in
            self.remote.mask(layer, self.predicted[layer, :B * H], self.predicted_scores[layer, :B * H],
                             self.active)
            if read and self.layer_reads is not None and self.layer_reads(self, layer):
                self.predict(layer, read=False)  # the missing blocks are local now

    def select(self, layer: int) -> None:
        """Capped eviction; under a transfer budget, first what each row would admit, then each
        row's share of the layer's budget (`fetch_budget`), then the admissions."""
        B, H = self.B, self.H
        n = B * H
        args = (self.resident[layer, :n], self.last[layer, :n], self.predicted[layer, :n], self.S,
                self.next_window[:B], H, self.C, self.step, self.admit_blocks[layer, :n],
                self.admit_slots[layer, :n], self.stats[:n])
        kw = dict(scores=self.predicted_scores[layer, :n], marks=self.eviction_marks)
        row_cap = None
        if self.budget.enabled:
            capped_eviction_(*args, **kw, candidates=(self.cand_rank[:n], self.cand_score[:n]))
            row_cap = self.row_cap[:n]
            share_budget(self.cand_rank[:n], self.cand_score[:n], self.budget_items, out=row_cap)
        capped_eviction_(*args, **kw, row_cap=row_cap, totals=self.step_totals)

    def transfer(self, layer: int) -> None:
        """Admitted items host -> their GPU slots (addresses computed in the copy kernel)."""
        B, H, t = self.B, self.H, self.tuning
        fetch_admitted(self.host_items, self.kv[layer], layer, self.admit_blocks[layer, :B * H],
                       self.admit_slots[layer, :B * H], self.pages[:B], self.extent_start[:B],
                       self.extent_blocks[:B], H, self.S, t.transfer_programs, t.transfer_items, t.transfer_warps)
        if self.remote is not None:
            self.remote.fetch(self.kv[layer], layer, self.admit_blocks[layer, :B * H],
                              self.admit_slots[layer, :B * H], self.pages[:B], self.S, t.transfer_programs,
                              t.transfer_items, t.transfer_warps)

    def write_through(self, wt: WriteThrough | None = None) -> None:
        """The blocks a step completed (this step's, or `wt`: the last step's), GPU -> host."""
        B = self.B
        completes, window_slot, block = wt if wt is not None else (self.completes, self.window_slot, self.block)
        write_through(self.kv, self.host_items, completes[:B], window_slot[:B], self.extent_start[:B],
                      self.extent_blocks[:B], block[:B], self.H, self.tuning.transfer_programs)
        if self.remote is not None:
            self.remote.write_through(self.kv, completes[:B], window_slot[:B], block[:B],
                                      self.tuning.transfer_programs)

    @property
    def fetched_bytes(self) -> int:
        """Host -> GPU bytes so far (admissions x item size); reads the counters (a sync)."""
        return int(self.stats[:, 2].sum()) * self.item_bytes

    # ---- sizes ---------------------------------------------------------------------
    @property
    def item_bytes(self) -> int:
        return 2 * self.bs * self.D * self.kv.element_size()


class PipelineTiming:
    """CUDA events recorded inside the captured step: when the foreground finished its layers,
    when the streams joined it, and when each layer's transfer finished."""

    def __init__(self, num_layers: int):
        ev = lambda: torch.cuda.Event(enable_timing=True, external=True)  # noqa: E731
        self.start, self.foreground_done, self.joined = ev(), ev(), ev()
        self.layer_done = [ev() for _ in range(num_layers)]

    def stall_seconds(self) -> float:
        """After a replay and a sync: how long the foreground waited at the join."""
        return self.foreground_done.elapsed_time(self.joined) / 1e3

    def read(self) -> dict:
        """After a replay and a sync: stall (ms) and how many layers finished after the
        foreground (their transfer missed the point where the step could have ended)."""
        fg = self.start.elapsed_time(self.foreground_done)
        return {"step_ms": self.start.elapsed_time(self.joined), "foreground_ms": fg,
                "stall_ms": self.foreground_done.elapsed_time(self.joined),
                "late_layers": sum(self.start.elapsed_time(e) > fg for e in self.layer_done)}
