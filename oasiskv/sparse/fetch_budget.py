"""The transfer budget of a decode step, in bytes (the cap C alone is a fixed ratio of K,
whatever the link can carry).

A step may move at most what crosses the host -> GPU link while its foreground runs: budget =
link rate x foreground time x margin, from the link rate measured at start-up and the
foreground time of recent steps (`FetchBudget`). The link carries less beside a busy foreground
than alone, and by how much depends on the card and the load: when the steps' stall (the join
waiting for the streams) passes STALL_TARGET the margin shrinks, and it grows back while they
stay under it, never past BUDGET_MARGIN. Each layer gets an equal share (every layer's
transfer has the same slack: one step; docs/design.md). Inside a layer the share goes to the
candidates of every row (request, kv head) by predicted value: a row's i-th best missing block
before any row's (i+1)-th (`share_budget`: by its rank in the row's prediction, then by score),
and never more than the per-head cap C of the fixed ratio, so an unlimited budget admits
exactly what the cap admits. All of it is tensor work with fixed shapes on the select stream,
inside the captured step; the host only writes the budget's value between steps.

On CPU (e.g. `oasiskv eval passkey` / `eval fidelity`) there is no link to
measure and no foreground is timed: `auto` there is NOMINAL_LINK_BYTES_PER_S x NOMINAL_STEP_S x
BUDGET_MARGIN (210 MB a step: the H200's measured UVA gather rate beside a decode step of its
size), which admits what the cap admits unless a step would move more than that; a number of MB
gives a tighter budget there too, shared the same way.
"""
from __future__ import annotations

import torch

from oasiskv.kernels import budget_share
from oasiskv.kernels.capped_eviction import NO_CANDIDATE

BUDGET_MODES = ("auto", "off")  # or a number: MB (10^6 bytes) per step
# The share of the foreground time the transfer may fill: the fetch slows beside the GEMMs and
# the attention (docs/design.md: 50 GB/s alone, less beside them), and the deferred layers cross
# into the next step; a larger margin left 48-row steps waiting at the join (docs/benchmarks.md,
# "End-to-end serving (scenarios)").
BUDGET_MARGIN = 0.7
NOMINAL_LINK_BYTES_PER_S = 50e9  # pinned host reads by a GPU kernel, H200
NOMINAL_STEP_S = 6e-3  # a batch-24 decode step of an 8B model on the H200
FOREGROUND_SMOOTHING = 0.2  # weight of the newest step in the running means (foreground, stall)
# The stall the margin holds the steps under (the join's wait over the step), how fast it moves
# (down per step over the target, up a quarter as fast under it) and its floor (a share of the
# full margin: the budget never falls below half of its full value).
STALL_TARGET, MARGIN_STEP, MIN_MARGIN_SHARE = 0.02, 0.02, 0.5


def parse_fetch_budget(value: str | float | None) -> str | float:
    """`--fetch-budget`: "auto", "off", or megabytes per step (a positive number)."""
    if value is None or value in BUDGET_MODES:
        return value or "auto"
    try:
        mb = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--fetch-budget must be auto, off or megabytes per step, got {value!r}") from None
    if mb <= 0:
        raise ValueError(f"--fetch-budget must be positive, got {value!r}")
    return mb


def share_budget(cand_rank: torch.Tensor, cand_score: torch.Tensor, items: torch.Tensor | int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's share of a layer's `items`: rows [N] of candidates [N, C] (their rank in the
    row's prediction, NO_CANDIDATE for none; and score), a row's best first. All candidates are
    ordered by rank, then score (higher first), then position; the first `items` are granted,
    and a row's share is how many of its own made it (a prefix of its list). Returns [N] int32
    (into `out` when given). On CUDA one Triton launch (`kernels/budget_share.py`); torch otherwise."""
    N, C = cand_rank.shape
    if out is None:
        out = torch.empty(N, dtype=torch.int32, device=cand_rank.device)
    if not isinstance(items, torch.Tensor):
        items = torch.tensor(items, dtype=torch.long, device=cand_rank.device)
    if cand_rank.is_cuda and budget_share.triton is not None and budget_share.SHARE_TILE_CANDIDATES > 0:
        budget_share.share_budget_triton(cand_rank, cand_score, items, out)
    else:
        out.copy_(share_budget_torch(cand_rank, cand_score, items))
    return out


def share_budget_torch(cand_rank: torch.Tensor, cand_score: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """`share_budget` by two stable sorts (score, then rank) and each candidate's place."""
    N, C = cand_rank.shape
    rank, score = cand_rank.reshape(-1).long(), cand_score.reshape(-1).float()
    order = score.argsort(descending=True, stable=True)
    order = order[rank[order].argsort(stable=True)]
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel(), device=order.device)
    granted = (place < items) & (rank < NO_CANDIDATE)
    return granted.view(N, C).sum(1).to(torch.int32)


class FetchBudget:
    """The budget's value per step, on the host: fixed megabytes, or `auto` from the link rate
    and the foreground time of recent steps. `items_per_layer` is what the select stage reads."""

    def __init__(self, setting: str | float, item_bytes: int, num_layers: int,
                 link_bytes_per_s: float = NOMINAL_LINK_BYTES_PER_S, margin: float = BUDGET_MARGIN):
        self.setting = parse_fetch_budget(setting)
        self.item_bytes, self.num_layers = item_bytes, num_layers
        self.link_bytes_per_s, self.max_margin, self.margin = link_bytes_per_s, margin, margin
        self.foreground_s = NOMINAL_STEP_S  # running mean of the measured foreground
        self.stall = 0.0  # running mean of the stall's share of a step

    @property
    def enabled(self) -> bool:
        return self.setting != "off"

    def observe(self, foreground_s: float, stall_s: float = 0.0) -> None:
        """A step's measured foreground time (its layers, without the wait at the join) and its
        stall (the wait at the join): the running means, and the margin they call for."""
        if foreground_s <= 0:
            return
        a = FOREGROUND_SMOOTHING
        self.foreground_s = (1 - a) * self.foreground_s + a * foreground_s
        self.stall = (1 - a) * self.stall + a * stall_s / (foreground_s + stall_s)
        if self.stall > STALL_TARGET:
            self.margin = max(MIN_MARGIN_SHARE * self.max_margin, self.margin * (1 - MARGIN_STEP))
        else:
            self.margin = min(self.max_margin, self.margin * (1 + MARGIN_STEP / 4))

    @property
    def step_bytes(self) -> int:
        """Bytes a step may move: link rate x foreground time x margin (the transfer keeps pace)."""
        if self.setting == "auto":
            return int(self.link_bytes_per_s * self.foreground_s * self.margin)
        return int(self.setting * 1e6)

    @property
    def items_per_layer(self) -> int:
        return max(0, self.step_bytes // (self.item_bytes * self.num_layers))


def measure_link(fetch, num_bytes: int, repeats: int = 3) -> float:
    """Host -> GPU bytes per second of `fetch()`, one call of which moves `num_bytes`, timed
    with CUDA events after a warm-up; the best of `repeats`."""
    fetch()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fetch()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return num_bytes / best
