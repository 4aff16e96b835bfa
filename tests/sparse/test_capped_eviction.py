"""Capped eviction (oasiskv/sparse/capped_eviction.py) against a slow per-row Python reference of the policy,
plus its invariants, on random multi-step histories (hypothesis)."""
from __future__ import annotations

import random

import torch
from hypothesis import given, settings, strategies as st

from oasiskv.sparse.capped_eviction import capped_eviction


def reference_row(resident, last, predicted, num_sink, window_start, cap, step):
    """The policy for one row, in plain Python. Returns (resident, last, admits, counts) where
    admits is [(block, slot)] in admission order and counts = (hits, missed, admitted, evicted)."""
    K = len(resident)
    preds, seen = [], set()
    for b in predicted:
        if b >= 0 and b not in seen:
            seen.add(b)
            preds.append(b)
    where = {b: i for i, b in enumerate(resident) if b >= 0}
    new_res, new_last = list(resident), list(last)
    hits, hit_slots, cands = 0, set(), []
    for b in preds:
        if b in where:  # (checked first: a resident is kept even if the window moved back)
            hits += 1
            hit_slots.add(where[b])
            new_last[where[b]] = step
        elif b < num_sink or b >= window_start:
            hits += 1
        else:
            cands.append(b)
    # Empty slots first, then least recently selected, then lower slot index.
    victims = sorted((i for i in range(K) if i not in hit_slots),
                     key=lambda i: (resident[i] >= 0, last[i] if resident[i] >= 0 else 0, i))
    n = min(cap, len(cands), len(victims))
    admits = list(zip(cands[:n], victims[:n]))
    evicted = sum(resident[s] >= 0 for _, s in admits)
    for b, s in admits:
        new_res[s], new_last[s] = b, step
    return new_res, new_last, admits, (hits, len(cands), n, evicted)


def random_prediction(rng, P, lo, hi):
    """P entries best first: distinct block ids in [lo, hi) (may include sink/window ids),
    padded with -1 when the range is short, occasionally with a duplicate."""
    ids = rng.sample(range(lo, hi), min(P, hi - lo)) if hi > lo else []
    if ids and rng.random() < 0.2:
        ids[-1] = ids[0]
    return ids + [-1] * (P - len(ids))


def check_plan(plan, resident, last, predicted, num_sink, window_start, cap, step):
    R, K = resident.shape
    assert plan.resident.shape == (R, K) and plan.admit_blocks.shape == (R, cap)
    assert plan.admit_slots.shape == (R, cap) and plan.resident.dtype == torch.int32
    for r in range(R):
        ws = int(window_start[r])
        res_r, last_r = resident[r].tolist(), last[r].tolist()
        exp_res, exp_last, admits, counts = reference_row(
            res_r, last_r, predicted[r].tolist(), num_sink, ws, cap, step)
        assert plan.resident[r].tolist() == exp_res
        assert plan.last_selected[r].tolist() == exp_last
        n = counts[2]
        assert plan.admit_blocks[r, :n].tolist() == [b for b, _ in admits]
        assert plan.admit_slots[r, :n].tolist() == [s for _, s in admits]
        assert (plan.admit_blocks[r, n:] == -1).all() and (plan.admit_slots[r, n:] == -1).all()
        assert (int(plan.hits[r]), int(plan.missed[r]), int(plan.admitted[r]),
                int(plan.evicted[r])) == counts
        # Invariants, stated directly (independent of the reference).
        assert n <= cap
        assert all(num_sink <= b < ws for b, _ in admits)  # sink/window never admitted
        new = [b for b in plan.resident[r].tolist() if b >= 0]
        assert len(new) == len(set(new))  # no block twice
        occupied = sum(b >= 0 for b in res_r)
        assert len(new) == occupied + n - counts[3]  # fills empty slots, otherwise replaces
        pred_set = {b for b in predicted[r].tolist() if b >= 0}
        victims = [s for _, s in admits if res_r[s] >= 0]
        survivors = [i for i in range(K) if res_r[i] >= 0 and res_r[i] not in pred_set
                     and i not in victims]
        for v in victims:  # LRU among the non-predicted residents
            assert res_r[v] not in pred_set
            assert all(last_r[v] <= last_r[i] for i in survivors)
        if victims:  # a block is evicted only once every empty slot is taken
            assert sum(b < 0 for b in res_r) == n - len(victims)


@settings(max_examples=150, deadline=None)
@given(R=st.integers(1, 5), K=st.integers(1, 8), P=st.integers(1, 10), cap=st.integers(0, 10),
       num_sink=st.integers(0, 2), steps=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_matches_reference_over_history(R, K, P, cap, num_sink, steps, seed):
    rng = random.Random(seed)
    resident = torch.full((R, K), -1, dtype=torch.int32)
    last = torch.zeros(R, K, dtype=torch.int64)
    num_blocks = [rng.randint(num_sink + 1, num_sink + 20) for _ in range(R)]
    for step in range(1, steps + 1):
        num_blocks = [n + rng.randint(0, 2) for n in num_blocks]  # the context grows
        window_start = torch.tensor([max(num_sink, n - rng.randint(0, 3)) for n in num_blocks])
        predicted = torch.tensor([random_prediction(rng, P, 0, n) for n in num_blocks],
                                 dtype=torch.int32)
        plan = capped_eviction(resident, last, predicted, num_sink, window_start, cap, step)
        check_plan(plan, resident, last, predicted, num_sink, window_start, cap, step)
        resident, last = plan.resident, plan.last_selected


@settings(max_examples=100, deadline=None)
@given(R=st.integers(1, 4), K=st.integers(1, 8), extra=st.integers(0, 4),
       num_sink=st.integers(0, 2), seed=st.integers(0, 2**31 - 1))
def test_stable_prediction_uncapped_converges_in_one_step(R, K, extra, num_sink, seed):
    """C >= K and a prediction of K dynamic blocks: after one step the working set is exactly
    the predicted set; the next step with the same prediction is all hits and moves nothing."""
    rng = random.Random(seed)
    n = num_sink + K + 6
    window_start = torch.full((R,), n - 2)
    resident = torch.tensor([rng.sample(range(num_sink, n - 2), K) for _ in range(R)],
                            dtype=torch.int32)
    resident[:, :rng.randint(0, K)] = -1  # some slots empty
    last = torch.randint(0, 5, (R, K))
    predicted = torch.tensor([rng.sample(range(num_sink, n - 2), K) for _ in range(R)],
                             dtype=torch.int32)
    plan = capped_eviction(resident, last, predicted, num_sink, window_start, K + extra, 7)
    for r in range(R):
        assert set(plan.resident[r].tolist()) == set(predicted[r].tolist())
    again = capped_eviction(plan.resident, plan.last_selected, predicted, num_sink,
                            window_start, K + extra, 8)
    assert (again.admitted == 0).all() and (again.hits == K).all()
    assert torch.equal(again.resident, plan.resident) and (again.last_selected == 8).all()


def test_cap_defers_and_sink_window_are_hits():
    """Hand-worked row: K=4, C=1, sink {0}, window from block 10."""
    resident = torch.tensor([[3, 4, -1, 6]], dtype=torch.int32)
    last = torch.tensor([[5, 2, 0, 1]])
    predicted = torch.tensor([[0, 8, 4, 11, 9, -1]], dtype=torch.int32)
    plan = capped_eviction(resident, last, predicted, 1, torch.tensor([10]), 1, 6)
    # 0 (sink), 11 (window) and 4 (resident) hit; 8 is admitted into the empty slot; 9 waits.
    assert plan.resident.tolist() == [[3, 4, 8, 6]]
    assert plan.last_selected.tolist() == [[5, 6, 6, 1]]
    assert plan.admit_blocks.tolist() == [[8]] and plan.admit_slots.tolist() == [[2]]
    assert (plan.hits.item(), plan.missed.item(), plan.admitted.item(), plan.evicted.item()) \
        == (3, 2, 1, 0)
    # Next step, cap 2: 9 and 12 are admitted, evicting 6 (selected at 1) then 3 (at 5).
    predicted = torch.tensor([[9, 12, 8, 4, -1, -1]], dtype=torch.int32)
    plan = capped_eviction(plan.resident, plan.last_selected, predicted, 1, torch.tensor([13]),
                           2, torch.tensor(7))
    assert plan.admit_blocks.tolist() == [[9, 12]] and plan.admit_slots.tolist() == [[3, 0]]
    assert plan.resident.tolist() == [[12, 4, 8, 9]] and plan.evicted.item() == 2
