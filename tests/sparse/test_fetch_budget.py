"""The transfer budget (`oasiskv.sparse.fetch_budget`): a step never admits more than its
bytes, shares them by rank in each row's prediction and then by score, and admits exactly what
the per-head cap admits when it is unlimited; the capped eviction's candidate listing and
per-row cap, in torch and (under the Triton interpreter) in the kernel."""
from __future__ import annotations

import json
import os

import pytest
import torch

from oasiskv.kernels.capped_eviction import NO_CANDIDATE
from oasiskv.sparse.capped_eviction import capped_eviction, capped_eviction_
from oasiskv.sparse.fetch_budget import MIN_MARGIN_SHARE, FetchBudget, parse_fetch_budget, share_budget
from triton_interpreter import run_under_interpreter


def random_state(reqs, heads, K, P, blocks, gen):
    """Rows with partly filled working sets and predictions that overlap them by chance; scores
    in any order (the fused top-K's output: a set, ranked by its scores)."""
    R = reqs * heads
    resident = torch.full((R, K), -1, dtype=torch.int32)
    predicted = torch.full((R, P), -1, dtype=torch.int32)
    for r in range(R):
        perm = torch.randperm(blocks, generator=gen)
        n_res = int(torch.randint(K // 2, K + 1, (1,), generator=gen))
        resident[r, :n_res] = perm[:n_res].int()
        n_pred = int(torch.randint(P // 2, P + 1, (1,), generator=gen))
        predicted[r, :n_pred] = torch.randperm(blocks, generator=gen)[:n_pred].int()
    scores = torch.where(predicted >= 0, torch.randn(R, P, generator=gen), float("-inf"))
    last = torch.randint(-1, 5, (R, K), generator=gen, dtype=torch.int32)
    window = torch.randint(blocks - 4, blocks, (reqs,), generator=gen)
    return resident, last, predicted, scores, window


def budgeted_select(state, heads, cap, items, select=capped_eviction_, **kw):
    """The pipeline's select stage under a budget: list candidates, share, admit. Returns the
    candidates (rank, score), the shares and the outputs (state, admissions, stats, totals)."""
    res, last, pred, scores, win = (t.clone() for t in state)
    R = res.shape[0]
    step = torch.tensor(9, dtype=torch.int32)
    ab = torch.full((R, cap), -1, dtype=torch.int32)
    asl, stats = ab.clone(), torch.zeros(R, 4, dtype=torch.long)
    rank, score = torch.zeros(R, cap, dtype=torch.int32), torch.zeros(R, cap)
    totals = torch.zeros(4, dtype=torch.long)
    args = (res, last, pred, 1, win, heads, cap, step, ab, asl, stats, scores)
    select(*args, **kw, candidates=(rank, score))
    share = share_budget(rank, score, torch.tensor(items))
    select(*args, **kw, row_cap=share, totals=totals)
    return rank, score, share, (res, last, ab, asl, stats, totals)


def test_share_never_exceeds_the_budget_and_goes_by_rank_then_score():
    gen = torch.Generator().manual_seed(1)
    for items in (0, 1, 5, 17, 40, 1000):
        N, C = 12, 4
        rank = torch.sort(torch.randint(0, 30, (N, C), generator=gen), 1).values.int()
        rank[torch.rand(N, C, generator=gen) < 0.3] = NO_CANDIDATE  # fewer candidates in some rows
        rank = torch.sort(rank.long(), 1).values.int()
        score = torch.where(rank < NO_CANDIDATE, torch.randn(N, C, generator=gen), float("-inf"))
        share = share_budget(rank, score, items)
        n_cand = (rank < NO_CANDIDATE).sum(1)
        assert int(share.sum()) == min(items, int(n_cand.sum()))
        assert bool((share <= n_cand).all())
        # Every granted candidate comes before every refused one in (rank, -score) order.
        granted = torch.arange(C)[None, :] < share[:, None]
        real = rank < NO_CANDIDATE
        key = lambda m: [(int(r), -float(s)) for r, s in zip(rank[m], score[m])]  # noqa: E731
        if granted.any() and (real & ~granted).any():
            assert max(key(granted)) <= min(key(real & ~granted))


def test_unlimited_budget_admits_what_the_cap_admits():
    gen = torch.Generator().manual_seed(2)
    for heads, cap in ((2, 1), (4, 3), (3, 7)):
        state = random_state(3, heads, 16, 16, 60, gen)
        _, _, share, got = budgeted_select(state, heads, cap, items=10**6)
        res, last, pred, scores, win = (t.clone() for t in state)
        R = res.shape[0]
        ab = torch.full((R, cap), -1, dtype=torch.int32)
        asl, stats = ab.clone(), torch.zeros(R, 4, dtype=torch.long)
        capped_eviction_(res, last, pred, 1, win, heads, cap, torch.tensor(9, dtype=torch.int32), ab, asl,
                         stats, scores)
        for a, b in zip(got[:5], (res, last, ab, asl, stats)):
            assert torch.equal(a, b)
        assert torch.equal(got[5], stats.sum(0))


def test_budget_bounds_the_admissions_and_takes_each_rows_best_first():
    gen = torch.Generator().manual_seed(3)
    heads, cap, items = 4, 5, 9
    state = random_state(4, heads, 16, 20, 80, gen)
    rank, score, share, (res, last, ab, asl, stats, totals) = budgeted_select(state, heads, cap, items)
    admitted = (ab >= 0).sum(1)
    assert int(admitted.sum()) == int(totals[2]) <= items
    assert torch.equal(admitted.int(), share)
    # A row's admissions are its best-scored missing blocks (its candidate list's prefix).
    _, _, pred, scores, _ = state
    for r in range(ab.shape[0]):
        for c in range(int(share[r])):
            at = (pred[r] == ab[r, c]).nonzero()[0, 0]
            assert float(scores[r, at]) == float(score[r, c])
            assert int(rank[r, c]) == int(((scores[r] > scores[r, at]) & (pred[r] >= 0)).sum())
    # The rows' candidates at the lowest ranks went first.
    granted = torch.arange(cap)[None, :] < share[:, None]
    real = rank < NO_CANDIDATE
    if (real & ~granted).any():
        assert int(rank[granted].max()) <= int(rank[real & ~granted].min())


def test_row_cap_lowers_the_cap_per_row():
    gen = torch.Generator().manual_seed(4)
    res, last, pred, scores, win = random_state(2, 3, 12, 12, 50, gen)
    pred = pred.gather(1, scores.argsort(1, descending=True))  # best first
    row_cap = torch.tensor([0, 1, 2, 3, 0, 5])
    plain = capped_eviction(res, last.long(), pred, 1, win.repeat_interleave(3), 4, 9)
    capped = capped_eviction(res, last.long(), pred, 1, win.repeat_interleave(3), 4, 9, row_cap)
    assert torch.equal(capped.admitted, torch.minimum(plain.admitted, row_cap.int()))
    for r in range(6):
        n = int(capped.admitted[r])
        assert torch.equal(capped.admit_blocks[r, :n], plain.admit_blocks[r, :n])


def test_budget_setting():
    assert parse_fetch_budget("auto") == "auto" and parse_fetch_budget("off") == "off"
    assert parse_fetch_budget("12.5") == 12.5
    for bad in ("0", "-1", "fast"):
        with pytest.raises(ValueError):
            parse_fetch_budget(bad)
    b = FetchBudget("auto", item_bytes=8192, num_layers=36, link_bytes_per_s=40e9, margin=0.5)
    for _ in range(200):
        b.observe(0.010)
    assert abs(b.step_bytes - 40e9 * 0.010 * 0.5) < 1e6  # the link x the foreground x the margin
    assert b.items_per_layer == b.step_bytes // (8192 * 36)
    assert FetchBudget(3, 8192, 36).step_bytes == 3_000_000
    assert not FetchBudget("off", 8192, 36).enabled


def test_auto_budget_shrinks_while_steps_stall_and_recovers():
    """Steps that wait at the join more than STALL_TARGET shrink the auto budget's margin, never
    below MIN_MARGIN_SHARE of it; steps under the target let it grow back, never past where it
    started. A budget in MB ignores the stall."""
    b = FetchBudget("auto", item_bytes=8192, num_layers=36, link_bytes_per_s=40e9, margin=0.7)
    for _ in range(200):
        b.observe(0.010, 0.0)
    full = b.step_bytes
    assert b.margin == 0.7
    margins = []
    for _ in range(400):  # 5% stall: down to the floor
        b.observe(0.010, 0.0005)
        margins.append(b.margin)
    assert margins[0] <= 0.7 and all(x >= y for x, y in zip(margins, margins[1:]))
    assert b.margin == pytest.approx(0.7 * MIN_MARGIN_SHARE)
    assert b.step_bytes == pytest.approx(full * MIN_MARGIN_SHARE, rel=1e-6)
    for _ in range(30):  # 1% stall, under the target: the running mean falls, then the margin grows
        b.observe(0.010, 0.0001)
    assert 0.7 * MIN_MARGIN_SHARE < b.margin < 0.7
    for _ in range(1000):
        b.observe(0.010, 0.0)
    assert b.margin == 0.7 and b.step_bytes == pytest.approx(full, abs=1)
    fixed = FetchBudget(30, 8192, 36)
    for _ in range(100):
        fixed.observe(0.010, 0.005)
    assert fixed.step_bytes == 30_000_000


# ---- the kernel, under the Triton interpreter ----------------------------------------------
SHARE_CASES = {"share_ties": (37, 5, 4, 23), "share_wide": (9, 20, 30, 50), "share_all": (20, 3, 6, 10**6),
               "share_none": (6, 4, 3, 0)}
KERNEL_CASES = {"budget_binds": (3, 4, 16, 16, 70, 5, 11), "unlimited": (2, 3, 8, 8, 40, 3, 10**6),
                "cap_one": (2, 2, 8, 8, 30, 1, 2)}


def share_inputs(N, C, ranks, gen):
    """Candidate lists as the capped eviction writes them: ranks ascending in a row, some rows
    short, scores with ties (rounded) so that the order's last key, the position, decides."""
    rank = torch.randint(0, ranks, (N, C), generator=gen)
    rank[torch.rand(N, C, generator=gen) < 0.25] = NO_CANDIDATE
    rank = torch.sort(rank, 1).values.int()
    score = torch.where(rank < NO_CANDIDATE, torch.randn(N, C, generator=gen).mul(2).round(), float("-inf"))
    return rank, score


def run_interpreter_cases() -> dict[str, float]:
    from oasiskv.kernels.capped_eviction import capped_eviction_triton, eviction_marks
    gen = torch.Generator().manual_seed(5)
    errors = {}
    for name, (reqs, heads, K, P, blocks, cap, items) in KERNEL_CASES.items():
        state = random_state(reqs, heads, K, P, blocks, gen)
        want = budgeted_select(state, heads, cap, items)
        marks = eviction_marks(reqs * heads, blocks, torch.device("cpu"))
        got = budgeted_select(state, heads, cap, items, select=capped_eviction_triton, marks=marks)
        flat = lambda x: [x[0], x[1], x[2], *x[3]]  # noqa: E731
        errors[name] = float(sum(not torch.equal(a.float(), b.float()) for a, b in zip(flat(want), flat(got))))
        errors[name] += float((marks != -1).sum())
    from oasiskv.kernels.budget_share import share_budget_triton
    from oasiskv.sparse.fetch_budget import share_budget_torch
    for name, (N, C, ranks, items) in SHARE_CASES.items():
        rank, score = share_inputs(N, C, ranks, gen)
        got = torch.full((N,), -7, dtype=torch.int32)
        share_budget_triton(rank, score, torch.tensor(items), got)
        errors[name] = float((got != share_budget_torch(rank, score, torch.tensor(items))).sum())
    return errors


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_under_interpreter(__file__)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KERNEL_CASES) + list(SHARE_CASES))
def test_budget_kernel_matches_torch_interpreter(interpreter_errors, name):
    assert interpreter_errors[name] == 0.0


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    print(json.dumps(run_interpreter_cases()))
