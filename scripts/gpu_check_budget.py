"""The transfer budget's GPU pieces against their torch forms, on random inputs: the capped
eviction's candidate listing (ranks, scores), its per-row cap and step totals, `share_budget`
on the device, and the step clock's stamps. Prints one JSON line; mismatches must be 0.

PYTHONPATH=. python3 scripts/gpu_check_budget.py
"""
from __future__ import annotations

import json

import torch

from oasiskv.kernels.capped_eviction import eviction_marks
from oasiskv.kernels.step_clock import stamp
from oasiskv.sparse.capped_eviction import capped_eviction_
from oasiskv.sparse.fetch_budget import share_budget


def random_state(reqs, heads, K, P, blocks, gen):
    R = reqs * heads
    resident = torch.full((R, K), -1, dtype=torch.int32)
    predicted = torch.full((R, P), -1, dtype=torch.int32)
    for r in range(R):
        perm = torch.randperm(blocks, generator=gen)
        n_res = int(torch.randint(K // 2, K + 1, (1,), generator=gen))
        resident[r, :n_res] = perm[:n_res].int()
        mix = torch.randperm(blocks, generator=gen)[:P]
        n_pred = int(torch.randint(P // 2, P + 1, (1,), generator=gen))
        predicted[r, :n_pred] = mix[:n_pred].int()
    scores = torch.where(predicted >= 0, torch.randn(R, P, generator=gen), float("-inf"))
    last = torch.randint(-1, 5, (R, K), generator=gen, dtype=torch.int32)
    window = torch.randint(blocks - 8, blocks, (reqs,), generator=gen)
    return resident, last, predicted, scores, window


def one_case(reqs, heads, K, P, blocks, cap, items, gen) -> int:
    res, last, pred, scores, win = random_state(reqs, heads, K, P, blocks, gen)
    R, out = reqs * heads, {}
    for dev in ("cpu", "cuda"):
        d = torch.device(dev)
        r, l, p, sc, w = (t.clone().to(d) for t in (res, last, pred, scores, win))  # (never the inputs)
        step = torch.tensor(7, dtype=torch.int32, device=d)
        ab = torch.full((R, cap), -1, dtype=torch.int32, device=d)
        asl, stats = ab.clone(), torch.zeros(R, 4, dtype=torch.long, device=d)
        rank = torch.zeros(R, cap, dtype=torch.int32, device=d)
        score = torch.zeros(R, cap, dtype=torch.float32, device=d)
        totals = torch.zeros(4, dtype=torch.long, device=d)
        marks = eviction_marks(R, blocks, d) if dev == "cuda" else None
        args = (r, l, p, 1, w, heads, cap, step, ab, asl, stats)
        capped_eviction_(*args, scores=sc, marks=marks, candidates=(rank, score))
        row_cap = share_budget(rank, score, torch.tensor(items, device=d))
        capped_eviction_(*args, scores=sc, marks=marks, row_cap=row_cap, totals=totals)
        out[dev] = [t.cpu() for t in (rank, score, row_cap, r, l, ab, asl, stats, totals)]
    bad = sum(not torch.equal(a, b) for a, b in zip(out["cpu"], out["cuda"]))
    bad += int(out["cuda"][2].sum()) > items  # never more than the budget
    return bad


def main():
    gen = torch.Generator().manual_seed(3)
    cases = {"48x8_k128_c7": (48, 8, 128, 128, 400, 7, 900), "16x8_k128_c7_unlimited": (16, 8, 128, 128, 700, 7, 10**6),
             "4x2_k32_c2": (4, 2, 32, 32, 90, 2, 5)}
    result = {name: one_case(*c, gen) for name, c in cases.items()}
    clock = torch.zeros(3, dtype=torch.long, device="cuda")
    stamp(clock, 0)
    torch.cuda._sleep(2_000_000)
    stamp(clock, 1)
    torch.cuda.synchronize()
    result["stamp_ns_apart"] = int(clock[1] - clock[0])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
