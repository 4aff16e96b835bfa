"""The capped eviction policy of `sparse/capped_eviction.py` (`capped_eviction_`, the pipeline's
in-place form) as one Triton program per row: the whole policy in registers, where the torch
version is ~40 launches a layer, too slow for the step's per-layer budget.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch version
    triton = None

NO_CANDIDATE = torch.iinfo(torch.int32).max  # rank of an unused candidate column (`admission_ranks`)


def eviction_marks(rows: int, max_blocks: int, device: torch.device) -> torch.Tensor:
    """The scratch `capped_eviction_` looks blocks up in on CUDA: one row of -1 per row of the
    state, one column per block id."""
    return torch.full((rows, max_blocks), -1, dtype=torch.int32, device=device)


# One warp a row while a row's vectors are this short: the policy is a chain of reductions over
# K and P elements, and within one warp each is a few shuffles, with no shared memory or
# barrier (the kernel's time in the step: docs/benchmarks.md, "Where the 16K step goes").
EVICTION_ONE_WARP = 512


def capped_eviction_triton(resident, last_selected, predicted, num_sink, window_start, num_heads,
                           cap, step, admit_blocks, admit_slots, stats, scores=None, marks=None,
                           row_cap=None, totals=None, candidates=None):
    """`capped_eviction_` on CUDA: one program per row (the arguments are that function's)."""
    R, K = resident.shape
    P = predicted.shape[1]
    assert resident.dtype == last_selected.dtype == predicted.dtype == torch.int32
    assert resident.is_contiguous() and last_selected.is_contiguous() and predicted.is_contiguous()
    assert scores is None or (scores.shape == predicted.shape and scores.is_contiguous())
    if not R:
        return
    if marks is None:
        width = max(int(resident.max()), int(predicted.max()), 0) + 1
        marks = eviction_marks(R, width, resident.device)
    assert marks.dtype == torch.int32 and marks.is_contiguous() and marks.shape[0] >= R
    KP, PP = triton.next_power_of_2(K), triton.next_power_of_2(P)
    cand_rank, cand_score = candidates if candidates is not None else (admit_blocks, admit_blocks)
    _capped_eviction_kernel[(R,)](
        resident, last_selected, predicted, predicted if scores is None else scores, window_start,
        step, admit_blocks, admit_slots, stats, marks, marks.shape[1], num_heads, K, P, cap, num_sink,
        stats if row_cap is None else row_cap, stats if totals is None else totals, cand_rank, cand_score,
        KP=KP, PP=PP, CP=triton.next_power_of_2(max(cap, 1)), RANKED=scores is not None,
        ROW_CAP=row_cap is not None, TOTALS=totals is not None, PLAN_ONLY=candidates is not None,
        num_warps=1 if max(KP, PP) <= EVICTION_ONE_WARP else 4)


if triton is not None:

    @triton.jit
    def _capped_eviction_kernel(res_ptr, last_ptr, pred_ptr, score_ptr, win_ptr, step_ptr, admit_blk_ptr,
                                admit_slot_ptr, stats_ptr, marks_ptr, marks_width, num_heads, K, P, cap,
                                num_sink, row_cap_ptr, totals_ptr, cand_rank_ptr, cand_score_ptr,
                                KP: tl.constexpr, PP: tl.constexpr, CP: tl.constexpr,
                                RANKED: tl.constexpr, ROW_CAP: tl.constexpr, TOTALS: tl.constexpr,
                                PLAN_ONLY: tl.constexpr):
        row = tl.program_id(0)
        row64 = row.to(tl.int64)
        k = tl.arange(0, KP)
        p = tl.arange(0, PP)
        c = tl.arange(0, CP)
        kmask = k < K
        res = tl.load(res_ptr + row64 * K + k, mask=kmask, other=-1)
        last = tl.load(last_ptr + row64 * K + k, mask=kmask, other=0)
        pred = tl.load(pred_ptr + row64 * P + p, mask=p < P, other=-1)
        win = tl.load(win_ptr + row // num_heads).to(tl.int32)
        step = tl.load(step_ptr)

        valid = pred >= 0
        static = valid & ((pred < num_sink) | (pred >= win))
        # Which predicted blocks are resident, and which slots hold a predicted block, through
        # the row's marks (block id -> slot, all -1 at rest): the resident blocks write their
        # slot, the predicted ones read it; then they write -2 and the slots read that back.
        # A barrier between the writes and the reads; volatile reads, so none comes from before.
        marks = marks_ptr + row64 * marks_width
        held = (res >= 0) & (res < marks_width)
        looked = valid & (pred < marks_width)
        tl.store(marks + res, k, mask=held)
        tl.debug_barrier()
        pred_resident = tl.load(marks + pred, mask=looked, other=-1, volatile=True) >= 0  # [PP]
        tl.debug_barrier()
        tl.store(marks + pred, tl.full([PP], -2, tl.int32), mask=looked)
        tl.debug_barrier()
        slot_hit = tl.load(marks + res, mask=held, other=-1, volatile=True) == -2  # [KP]
        tl.debug_barrier()
        tl.store(marks + res, tl.full([KP], -1, tl.int32), mask=held)
        tl.store(marks + pred, tl.full([PP], -1, tl.int32), mask=looked)
        cand = valid & (static == 0) & (pred_resident == 0)
        missed = tl.sum(cand.to(tl.int32), axis=0)
        hits = tl.sum(valid.to(tl.int32), axis=0) - missed

        # Victim order: empty slots, then least recently selected, then lower slot (argmin
        # breaks ties to the left); hit slots and padding are never taken.
        BIG: tl.constexpr = 2147483647
        key = tl.where(res < 0, -BIG, last)
        key = tl.where(slot_hit | (kmask == 0), BIG, key)
        num_victims = tl.sum((kmask & (slot_hit == 0)).to(tl.int32), axis=0)
        n_admit = tl.minimum(tl.minimum(missed, num_victims), cap)
        if ROW_CAP:  # the row's share of the transfer budget
            n_admit = tl.minimum(n_admit, tl.load(row_cap_ptr + row))
        if RANKED:  # admission order: best score first (ties: the earlier entry)
            raw = tl.load(score_ptr + row64 * P + p, mask=p < P, other=float("-inf"))
            order = tl.where(cand, tl.maximum(raw, -3.0e38), float("-inf"))
        else:  # the list is best first already
            rank = tl.cumsum(cand.to(tl.int32), axis=0) - 1
            vrank = tl.cumsum(valid.to(tl.int32), axis=0) - 1  # place among the valid entries
        cand_rank = tl.full([CP], 2147483647, tl.int32)  # PLAN_ONLY: each admission's rank, score
        cand_score = tl.full([CP], float("-inf"), tl.float32)

        admit_blk = tl.full([CP], -1, tl.int32)
        admit_slot = tl.full([CP], -1, tl.int32)
        evicted = n_admit * 0
        for i in range(0, n_admit):
            if RANKED:
                best = tl.argmax(order, axis=0, tie_break_left=True)
                blk = tl.sum(tl.where(p == best, pred, 0), axis=0)
                order = tl.where(p == best, float("-inf"), order)
                if PLAN_ONLY:  # its place in the row's prediction: better scores, then earlier ties
                    sb = tl.max(tl.where(p == best, raw, float("-inf")), axis=0)
                    ahead = valid & ((raw > sb) | ((raw == sb) & (p < best)))
                    cand_rank = tl.where(c == i, tl.sum(ahead.to(tl.int32), axis=0), cand_rank)
                    cand_score = tl.where(c == i, sb, cand_score)
            else:
                blk = tl.sum(tl.where(cand & (rank == i), pred, 0), axis=0)
                if PLAN_ONLY:
                    vr = tl.sum(tl.where(cand & (rank == i), vrank, 0), axis=0)
                    cand_rank = tl.where(c == i, vr, cand_rank)
                    cand_score = tl.where(c == i, -vr.to(tl.float32), cand_score)
            victim = tl.argmin(key, axis=0, tie_break_left=True).to(tl.int32)
            at = k == victim
            evicted += (tl.sum(tl.where(at, res, 0), axis=0) >= 0).to(tl.int32)
            res = tl.where(at, blk, res)
            last = tl.where(at, step, last)
            key = tl.where(at, BIG, key)
            admit_blk = tl.where(c == i, blk, admit_blk)
            admit_slot = tl.where(c == i, victim, admit_slot)
        last = tl.where(slot_hit, step, last)

        if PLAN_ONLY:  # the budget's input only; the state stays as it was
            tl.store(cand_rank_ptr + row64 * cap + c, cand_rank, mask=c < cap)
            tl.store(cand_score_ptr + row64 * cap + c, cand_score, mask=c < cap)
        else:
            tl.store(res_ptr + row64 * K + k, res, mask=kmask)
            tl.store(last_ptr + row64 * K + k, last, mask=kmask)
            tl.store(admit_blk_ptr + row64 * cap + c, admit_blk, mask=c < cap)
            tl.store(admit_slot_ptr + row64 * cap + c, admit_slot, mask=c < cap)
            s = stats_ptr + row64 * 4
            tl.store(s + 0, tl.load(s + 0) + hits)
            tl.store(s + 1, tl.load(s + 1) + missed)
            tl.store(s + 2, tl.load(s + 2) + n_admit)
            tl.store(s + 3, tl.load(s + 3) + evicted)
            if TOTALS:
                tl.atomic_add(totals_ptr + 0, hits.to(tl.int64))
                tl.atomic_add(totals_ptr + 1, missed.to(tl.int64))
                tl.atomic_add(totals_ptr + 2, n_admit.to(tl.int64))
                tl.atomic_add(totals_ptr + 3, evicted.to(tl.int64))
