"""The pipeline's Triton kernels against their torch forms, under TRITON_INTERPRET=1 (one
subprocess runs this file as a script): the in-place capped eviction over several steps of
random histories (its block marks left all -1 by each call), the bounded-grid item copy
(transfer / write-through), and the step's foreground tables (one launch) on random states.
The GPU machine checks them again (scripts/gpu_check_pipeline.py; the step tables in
scripts/gpu_check_kernels.py)."""
import json
import os

import pytest
import torch

from triton_interpreter import run_under_interpreter

pytestmark = pytest.mark.slow

EVICTION_CASES = {  # id: (requests, heads, K, predicted width, blocks, cap, sinks)
    "cap1": (2, 3, 8, 8, 40, 1, 1),
    "cap3_short_pred": (3, 2, 8, 5, 30, 3, 2),
    "cap_eq_k": (2, 2, 6, 6, 20, 6, 1),
    "cap_over_k": (1, 4, 4, 8, 24, 10, 0),
}


def random_eviction_inputs(reqs, heads, K, P, blocks, sinks, gen):
    R = reqs * heads
    resident = torch.full((R, K), -1, dtype=torch.int32)
    predicted = torch.full((R, P), -1, dtype=torch.int32)
    for r in range(R):
        perm = torch.randperm(blocks, generator=gen)
        n_res = int(torch.randint(K // 2, K + 1, (1,), generator=gen))
        resident[r, :n_res] = perm[:n_res].int()
        resident[r] = resident[r, torch.randperm(K, generator=gen)]
        mix = torch.randperm(blocks, generator=gen)[:P]  # overlaps the resident set by chance
        n_pred = int(torch.randint(1, P + 1, (1,), generator=gen))
        predicted[r, :n_pred] = mix[:n_pred].int()
    last = torch.randint(-1, 5, (R, K), generator=gen, dtype=torch.int32)
    window_start = torch.randint(blocks // 2, blocks, (reqs,), generator=gen)
    return resident, last, predicted, window_start


def run_interpreter_cases() -> dict[str, float]:
    from oasiskv.kernels.capped_eviction import capped_eviction_triton, eviction_marks
    from oasiskv.kernels.copy_items import _copy_items_triton
    from oasiskv.sparse.capped_eviction import capped_eviction_
    errors = {}
    gen = torch.Generator().manual_seed(7)
    for name, (reqs, heads, K, P, blocks, cap, sinks) in EVICTION_CASES.items():
        res, last, pred, win = random_eviction_inputs(reqs, heads, K, P, blocks, sinks, gen)
        state = {impl: (res.clone(), last.clone()) for impl in ("torch", "triton", "triton_ranked", "torch_ranked")}
        marks = eviction_marks(reqs * heads, blocks, torch.device("cpu"))  # the Triton runs' scratch, kept across steps
        mismatches = 0
        for step in range(1, 5):  # several steps: each starts from the state the last left
            if step > 1:
                _, _, pred, win = random_eviction_inputs(reqs, heads, K, P, blocks, sinks, gen)
            # The same prediction as an unordered set with scores (the fused top-K's output).
            scores = torch.where(pred >= 0, -torch.arange(P, dtype=torch.float32), float("-inf"))
            shuffle = torch.rand(pred.shape, generator=gen).argsort(1)
            ranked = (pred.gather(1, shuffle).contiguous(), scores.gather(1, shuffle).contiguous())
            outs = {}
            for impl, fn, args in (("torch", capped_eviction_, (pred,)),
                                   ("triton", capped_eviction_triton, (pred,)),
                                   ("triton_ranked", capped_eviction_triton, ranked),
                                   ("torch_ranked", capped_eviction_, ranked)):
                r, l = state[impl]
                ab = torch.full((reqs * heads, cap), -1, dtype=torch.int32)
                asl = torch.full_like(ab, -1)
                stats = torch.zeros(reqs * heads, 4, dtype=torch.long)
                extra = {"marks": marks} if impl.startswith("triton") else {}
                fn(r, l, args[0], sinks, win, heads, cap, torch.tensor(step, dtype=torch.int32), ab, asl, stats,
                   *args[1:], **extra)
                outs[impl] = (r, l, ab, asl, stats)
                mismatches += int((marks != -1).sum())  # every call leaves its marks as it found them
            for impl in ("triton", "triton_ranked", "torch_ranked"):
                mismatches += sum(not torch.equal(a.long(), b.long()) for a, b in zip(outs["torch"], outs[impl]))
        errors["evict_" + name] = float(mismatches)
    for name, dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
        src = torch.randn(12, 2, 4, 16, generator=gen).to(dtype)
        dst = torch.randn(9, 2, 4, 16, generator=gen).to(dtype)
        src_idx = torch.tensor([3, -1, 0, 11, 5, 7], dtype=torch.long)
        dst_idx = torch.tensor([8, 2, 0, 4, -1, 1], dtype=torch.long)
        want = dst.clone()
        for s, d in zip(src_idx.tolist(), dst_idx.tolist()):
            if s >= 0 and d >= 0:
                want[d] = src[s]
        _copy_items_triton(src, dst, src_idx, dst_idx, 2)  # each program loops over items
        errors["copy_" + name] = (dst.float() - want.float()).abs().max().item()
    errors.update(run_sparse_copy_cases(gen))
    errors.update(run_step_table_cases(gen))
    return errors


STEP_TABLE_CASES = {  # id: (layers, rows, heads, sinks, K, window, block size)
    "s1_k6_w3": (3, 5, 2, 1, 6, 3, 4),
    "s0_k4_w1": (2, 4, 3, 0, 4, 1, 4),
    "s2_k8_w4_bs2": (2, 6, 1, 2, 8, 4, 2),
}


def random_step_state(L, R, H, S, K, W, bs, gen):
    """Rows at every kind of position: a block's first token (partial 0), the window still
    reaching back into the sinks, long rows; some inactive; dynamic slots partly empty."""
    P = S + K + W
    cached = torch.randint(0, 40 * bs, (R,), generator=gen, dtype=torch.int32)
    cached[0] = 2 * bs  # the window starts inside the sinks
    cached[1] = 37 * bs  # a block's first token
    cached[2] = bs // 2  # shorter than one block: its partial block is a sink
    active = torch.rand(R, generator=gen) < 0.8
    active[:2] = True
    pages = torch.stack([torch.randperm(4 * R * P, generator=gen)[:P] for _ in range(R)]).int()
    resident = torch.randint(S, 40, (L, (R + 2) * H, K), generator=gen, dtype=torch.int32)  # rows past R unused
    resident[torch.rand(resident.shape, generator=gen) < 0.3] = -1
    summary_offset = torch.randint(0, 1000, (R,), generator=gen)
    return cached, active, pages, resident, summary_offset


def run_step_table_cases(gen) -> dict[str, float]:
    """The step's foreground tables, the Triton kernel against the torch form: every output and
    every row value equal, and the last step's write-through values kept (mismatching outputs
    counted; the kept values must be the rows' values from before the call)."""
    from oasiskv.kernels.step_tables import RowState, WriteThrough, step_tables_torch, step_tables_triton
    out = {}
    dtypes = (torch.long, torch.long, torch.bool, torch.long, torch.long, torch.long, torch.bool)
    for name, (L, R, H, S, K, W, bs) in STEP_TABLE_CASES.items():
        state = random_step_state(L, R, H, S, K, W, bs, gen)
        before = RowState(*(torch.randint(0, 2 if d == torch.bool else 99, (R,), generator=gen).to(d) for d in dtypes))
        rows = {impl: RowState(*(t.clone() for t in before)) for impl in ("torch", "triton")}
        last = {impl: WriteThrough(torch.zeros(R, dtype=torch.bool), torch.zeros(R, dtype=torch.long),
                                   torch.zeros(R, dtype=torch.long)) for impl in ("torch", "triton")}
        want = step_tables_torch(*state, H, S, W, bs, 120, rows["torch"], last["torch"])
        got = step_tables_triton(*state, H, S, W, bs, 120, rows["triton"], last["triton"])
        pairs = list(zip(want, got)) + list(zip(rows["torch"], rows["triton"])) + list(zip(last["torch"], last["triton"]))
        pairs += list(zip(last["triton"], before[2:5]))
        out["tables_" + name] = float(sum(not torch.equal(a, b) for a, b in pairs))
    return out


def run_sparse_copy_cases(gen) -> dict[str, float]:
    """The transfer and write-through kernels (addresses computed in the kernel) against their
    torch forms, on a small arena: 3 requests, 2 layers, 2 heads, 6 blocks, 4 working-set pages."""
    from oasiskv.kernels import copy_items as ci
    L, R, H, NB, P, S, C = 2, 3, 2, 6, 4, 1, 2
    host = torch.randn(R * L * NB * H + 5, 2, 4, 8, generator=gen)
    kv = torch.randn(L, 40 * H, 2, 4, 8, generator=gen)
    pages = torch.tensor([[3, 7, 1, 9], [0, 2, 4, 6], [11, 13, 5, 8]], dtype=torch.int32)
    start = torch.tensor([5, 5 + L * NB * H, 5 + 2 * L * NB * H])
    nblocks = torch.full((R,), NB)
    blocks = torch.tensor([[2, -1], [4, 1], [-1, -1], [3, 0], [5, -1], [1, 2]], dtype=torch.int32)
    slots = torch.tensor([[0, -1], [1, 2], [-1, -1], [2, 0], [1, -1], [0, 1]], dtype=torch.int32)
    out = {}
    want, got = kv[1].clone(), kv[1].clone()
    ci.fetch_admitted(host, want, 1, blocks, slots, pages, start, nblocks, H, S)  # torch form (CPU)
    ci._fetch_kernel[(2,)](host, got, blocks, slots, pages, start, nblocks, 1, R * H * C, C, H, P, S,
                           ITEM=64, ITEMP=64, ITEMS=4)
    out["fetch"] = (got - want).abs().max().item()
    done = torch.tensor([True, False, True])
    wslot = torch.tensor([2 * H, 5 * H, 8 * H])
    block = torch.tensor([4, 1, 0])
    want_h, got_h = host.clone(), host.clone()
    ci.write_through(kv, want_h, done, wslot, start, nblocks, block, H)
    ci._write_through_kernel[(2,)](kv, got_h, done, wslot, start, nblocks, block, L, R, H, 40 * H,
                                   ITEM=64, ITEMP=64, ITEMS=4)
    out["write_through"] = (got_h - want_h).abs().max().item()
    out["write_through_moved"] = float((want_h != host).any(-1).any(-1).any(-1).sum())
    return out


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_under_interpreter(__file__)
@pytest.mark.parametrize("name", list(EVICTION_CASES), ids=str)
def test_capped_eviction_triton_interpreter(interpreter_errors, name):
    assert interpreter_errors["evict_" + name] == 0.0


@pytest.mark.parametrize("name", ["fp16", "fp32"])
def test_copy_items_triton_interpreter(interpreter_errors, name):
    assert interpreter_errors["copy_" + name] == 0.0


@pytest.mark.parametrize("name", list(STEP_TABLE_CASES))
def test_step_tables_triton_interpreter(interpreter_errors, name):
    assert interpreter_errors["tables_" + name] == 0.0


def test_fetch_and_write_through_interpreter(interpreter_errors):
    assert interpreter_errors["fetch"] == 0.0
    assert interpreter_errors["write_through"] == 0.0
    assert interpreter_errors["write_through_moved"] == 2 * 2 * 2  # two rows x layers x heads


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    print(json.dumps(run_interpreter_cases()))
