"""Capped eviction: the selection stage of the lookahead pipeline (docs/design.md, "A decode
step of a sparse request"): keep what is resident, admit at most C new blocks, evict the least
recently selected; batched over rows, a row = one (request, layer, kv head).

Each row owns K dynamic slots; sink and window blocks sit in other slots this policy never
sees. Given the predicted top-K (best first):
  - predicted blocks already resident stay, and their last-selected step becomes `step`;
  - predicted sink / window blocks are on the GPU anyway: hits, never admitted (a resident
    block is kept as a hit even if it lies in that range, which only a window moving back
    could cause);
  - at most C nonresident predicted blocks are admitted, best score first (the cap bounds the
    traffic of a step to C items per head and layer: <= C · heads · layers);
  - each admission takes one victim slot: empty slots first, then residents outside the
    prediction, least recently selected first (ties: lower slot index).
Predicted blocks over the cap wait for a later step; the working set keeps its K slots.

Pure tensor code with fixed output shapes and no host sync, so it can be captured in a CUDA
graph (pass `step` as a device tensor then: a Python int would be frozen into the graph).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from oasiskv.kernels.capped_eviction import NO_CANDIDATE, capped_eviction_triton, triton

_NEVER = torch.iinfo(torch.int64).min  # sort key of an empty slot: taken before any resident
_KEEP = torch.iinfo(torch.int64).max  # sort key of a hit slot: never a victim


@dataclass(slots=True)
class EvictionPlan:
    """Result of one step of `capped_eviction`; every tensor has a fixed shape."""
    resident: torch.Tensor  # [R, K] int32 block id per dynamic slot, -1 empty
    last_selected: torch.Tensor  # [R, K] int64 step each slot's block was last predicted
    admit_blocks: torch.Tensor  # [R, C] int32 blocks to copy host -> GPU, best first, -1 none
    admit_slots: torch.Tensor  # [R, C] int32 dynamic slot (0..K-1) receiving each, -1 none
    hits: torch.Tensor  # [R] int32 predicted blocks already on the GPU (resident, sink, window)
    missed: torch.Tensor  # [R] int32 predicted blocks not on the GPU (admitted + over the cap)
    admitted: torch.Tensor  # [R] int32
    evicted: torch.Tensor  # [R] int32 admissions that displaced a block (not an empty slot)


def capped_eviction(resident: torch.Tensor, last_selected: torch.Tensor,
                    predicted: torch.Tensor, num_sink: int, window_start: torch.Tensor,
                    cap: int, step: int | torch.Tensor, row_cap: torch.Tensor | None = None) -> EvictionPlan:
    """One selection step for R rows.

    resident: [R, K] int32 block ids (-1 empty); last_selected: [R, K] int64;
    predicted: [R, P] int32 logical block ids sorted best first (-1 padding);
    blocks b < num_sink or b >= window_start [R] are sink/window (already on the GPU);
    cap: C >= 0 admissions per row at most; step: the step being selected for;
    row_cap: [R] a lower cap per row (the transfer budget's share, `fetch_budget`).
    Inputs are not modified.
    """
    R, K = resident.shape
    P = predicted.shape[1]
    assert K >= 1 and cap >= 0
    dev = resident.device
    pred = predicted.long()
    res = resident.long()
    valid = pred >= 0
    # A block listed twice counts once (the first, better-ranked, entry).
    j = torch.arange(P, device=dev)
    earlier = (pred[:, :, None] == pred[:, None, :]) & (j[None, :] < j[:, None])[None]  # [R, P, P]
    valid &= ~earlier.any(2)
    window_start = _long(window_start, dev).reshape(-1, 1)
    static = valid & ((pred < num_sink) | (pred >= window_start))
    match = (pred[:, :, None] == res[:, None, :]) & (valid[:, :, None] & (res >= 0)[:, None, :])
    pred_resident = match.any(2)  # [R, P]
    slot_hit = match.any(1)  # [R, K]
    cand = valid & ~static & ~pred_resident  # nonresident, admissible, in score order
    missed = cand.sum(1)

    # Victims: every slot not holding a predicted block, empty slots first, then LRU.
    key = torch.where(res < 0, _NEVER, last_selected.long())
    key = torch.where(slot_hit, _KEEP, key)
    victims = torch.sort(key, dim=1, stable=True).indices  # [R, K]
    num_victims = K - slot_hit.sum(1)
    n_admit = torch.minimum(torch.minimum(missed, num_victims), torch.full_like(missed, cap))
    if row_cap is not None:
        n_admit = torch.minimum(n_admit, row_cap.to(dev, torch.long))

    rank = cand.long().cumsum(1) - 1  # admission order of each candidate
    admit = cand & (rank < n_admit[:, None])
    # Scatter admitted candidates to their rank; the rest go to a dump column C, cut off after.
    dst = torch.where(admit, rank, cap)
    admit_blocks = torch.full((R, cap + 1), -1, dtype=torch.long, device=dev)
    admit_blocks.scatter_(1, dst, torch.where(admit, pred, -1))
    admit_blocks = admit_blocks[:, :cap]
    c = torch.arange(cap, device=dev)
    used = c[None, :] < n_admit[:, None]  # [R, C]
    admit_slots = victims[:, :min(cap, K)]
    if cap > K:
        admit_slots = torch.cat([admit_slots, admit_slots.new_zeros(R, cap - K)], 1)
    admit_slots = torch.where(used, admit_slots, -1)

    # New working set: hit slots re-stamped, victims overwritten (dump column K for unused).
    step_t = _long(step, dev)
    new_res = torch.cat([res, res.new_full((R, 1), -1)], 1)
    new_last = torch.cat([torch.where(slot_hit, step_t, last_selected.long()),
                          last_selected.new_zeros(R, 1).long()], 1)
    dst_slot = torch.where(used, admit_slots, K)
    new_res.scatter_(1, dst_slot, admit_blocks)
    new_last.scatter_(1, dst_slot, step_t.expand(R, cap))
    evicted = (used & (res.gather(1, dst_slot.clamp_max(K - 1)) >= 0)).sum(1)
    hits = valid.sum(1) - missed
    i32 = torch.int32
    return EvictionPlan(resident=new_res[:, :K].to(i32), last_selected=new_last[:, :K],
                        admit_blocks=admit_blocks.to(i32), admit_slots=admit_slots.to(i32),
                        hits=hits.to(i32), missed=missed.to(i32), admitted=n_admit.to(i32),
                        evicted=evicted.to(i32))


def admission_ranks(admit_blocks: torch.Tensor, predicted: torch.Tensor,
                    scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Of each admission a plan lists ([R, C], best first, -1 none): its rank in the row's
    prediction ([R, P] best first; 0 = the best predicted block, hits included) and its score
    (`scores` [R, P] in the same order; without them, minus the rank). Unused columns get
    NO_CANDIDATE and -inf: the inputs of `fetch_budget.share_budget`."""
    P = predicted.shape[1]
    pred = predicted.long()
    valid = pred >= 0
    j = torch.arange(P, device=pred.device)
    earlier = (pred[:, :, None] == pred[:, None, :]) & (j[None, :] < j[:, None])[None]
    valid &= ~earlier.any(2)  # a block listed twice counts once, as in `capped_eviction`
    vrank = valid.long().cumsum(1) - 1
    used = admit_blocks >= 0
    eq = (admit_blocks.long()[:, :, None] == pred[:, None, :]) & valid[:, None, :]  # [R, C, P]
    at = eq.int().argmax(2)  # the admitted block's entry in the prediction
    rank = torch.where(used, vrank.gather(1, at), NO_CANDIDATE)
    score = -rank.float() if scores is None else scores.float().gather(1, at)
    return rank.to(torch.int32), torch.where(used, score, float("-inf"))


def _long(x: int | torch.Tensor, dev: torch.device) -> torch.Tensor:
    """An int64 tensor on `dev`; a Python int becomes a fill (no host->device copy, which a
    CUDA graph capture would refuse), with its value frozen into a captured graph."""
    if isinstance(x, torch.Tensor):
        return x.to(dev, torch.long)
    return torch.full((), x, dtype=torch.long, device=dev)


# --------------------------------------------------------------------------- in place (pipeline)

STAT_HITS, STAT_MISSED, STAT_ADMITTED, STAT_EVICTED = range(4)


def capped_eviction_(resident: torch.Tensor, last_selected: torch.Tensor, predicted: torch.Tensor,
                     num_sink: int, window_start: torch.Tensor, num_heads: int, cap: int,
                     step: torch.Tensor, admit_blocks: torch.Tensor, admit_slots: torch.Tensor,
                     stats: torch.Tensor, scores: torch.Tensor | None = None,
                     marks: torch.Tensor | None = None, row_cap: torch.Tensor | None = None,
                     totals: torch.Tensor | None = None,
                     candidates: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The pipeline's form of `capped_eviction`: same policy, state updated in place.

    resident, last_selected: [R, K] int32 (rows = request * num_heads + head); predicted: [R, P]
    int32 without duplicates, best first, or in any order when `scores` [R, P] float32 (the
    fused top-K's set, `score_select`) rank them; window_start: [R // num_heads] per
    request; step: int32 device scalar. Writes admit_blocks / admit_slots [R, cap] (-1 unused)
    and adds (hits, missed, admitted, evicted) to stats [R, 4] int64.

    On CUDA one Triton program per row does the whole policy in registers
    (`kernels/capped_eviction.py`); elsewhere it is the torch version. The kernel finds which
    predicted blocks are resident through `marks` [>= R, W] int32, all -1 (`eviction_marks`), W
    above every block id: it leaves them -1 again. Inside a captured graph pass them (without,
    they are made there, which reads the largest block id: a sync).

    The transfer budget (`fetch_budget`) calls it twice a layer: first with `candidates`
    ([R, cap] int32 ranks, [R, cap] float32 scores; `admission_ranks`), which only lists what
    each row would admit and changes no state; then with `row_cap` [R], each row's share.
    totals: [4] int64, the step's (hits, missed, admitted, evicted) summed over rows."""
    if resident.is_cuda and triton is not None:
        capped_eviction_triton(resident, last_selected, predicted, num_sink, window_start,
                               num_heads, cap, step, admit_blocks, admit_slots, stats, scores, marks,
                               row_cap, totals, candidates)
        return
    ranked_scores = None
    if scores is not None:  # best first; stable, so equal scores keep their order
        order = scores.sort(dim=1, descending=True, stable=True).indices
        predicted, ranked_scores = predicted.gather(1, order), scores.gather(1, order)
    win = window_start.long().repeat_interleave(num_heads)
    plan = capped_eviction(resident, last_selected.long(), predicted, num_sink, win, cap, step, row_cap)
    if candidates is not None:
        rank, score = admission_ranks(plan.admit_blocks, predicted, ranked_scores)
        candidates[0].copy_(rank)
        candidates[1].copy_(score)
        return
    resident.copy_(plan.resident)
    last_selected.copy_(plan.last_selected)
    admit_blocks.copy_(plan.admit_blocks)
    admit_slots.copy_(plan.admit_slots)
    counts = torch.stack([plan.hits, plan.missed, plan.admitted, plan.evicted], 1).long()
    stats += counts
    if totals is not None:
        totals += counts.sum(0)
