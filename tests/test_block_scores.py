"""Block scores (DESIGN §3 step 3): the reference against brute force over the tokens, the
torch path against the reference, top-K, and the Triton kernel against the reference under
Triton's CPU interpreter (in a subprocess, as tests/test_kernels.py does: TRITON_INTERPRET must
be set before triton is imported). Interpreter cases use float32/float16 only (DESIGN §6);
bf16 is checked on the GPU by scripts/gpu_check_sparse.py."""
from __future__ import annotations

import json
import os

import pytest
import torch
from triton_interpreter import run_under_interpreter

from oasiskv.sparse.block_scores import (score_blocks_ref, score_blocks_torch,
                                         score_topk, topk_blocks)
from oasiskv.sparse.summaries import block_minmax

# Scores are float32 sums of 2·D products in every path; only the order differs, so the gap
# is float32 rounding: 1e-5 of the row's largest |score| (which is ~10..100 here).
REL_TOL = 1e-5


def make_inputs(R, Hkv, G, D, num_blocks, dtype, bs=4, seed=0):
    """Random keys -> real summaries (kmin <= kmax) of ragged sequences packed at offsets with
    a gap block between them (never read), and random draft queries."""
    gen = torch.Generator().manual_seed(seed)
    nb = torch.tensor(num_blocks, dtype=torch.int32)
    offsets = torch.cumsum(nb + 1, 0).to(torch.int32) - nb - 1
    total = int((nb + 1).sum())
    keys = torch.randn(total * bs, Hkv, D, generator=gen).to(dtype)
    kmin, kmax = block_minmax(keys, bs)
    q = torch.randn(R, G * Hkv, D, generator=gen).to(dtype)
    return q, kmin, kmax, offsets, nb, keys


def rel_err(a, b):
    """Max |a - b| over finite entries / max |b|; requires the -inf entries to coincide."""
    assert torch.equal(torch.isneginf(a), torch.isneginf(b))
    fin = torch.isfinite(b)
    if not fin.any():
        return 0.0
    return ((a - b).abs()[fin].max() / b.abs()[fin].max()).item()


def topk_agrees(ids, ref_scores, k, rel_tol=1e-4):
    """`ids` [R, H, k] is a valid top-k of `ref_scores` [R, H, M] up to near-ties: same number
    of valid entries, and every block in one set but not the other scores within tolerance of
    the k-th best score."""
    ref_ids, ref_vals = topk_blocks(ref_scores, k)
    scale = ref_scores[torch.isfinite(ref_scores)].abs().max() if torch.isfinite(ref_scores).any() else 1
    for r in range(ids.shape[0]):
        for h in range(ids.shape[1]):
            a = {i for i in ids[r, h].tolist() if i >= 0}
            b = {i for i in ref_ids[r, h].tolist() if i >= 0}
            if len(a) != len(b):
                return False
            kth = ref_vals[r, h, len(b) - 1] if b else 0
            for i in a ^ b:
                if abs(ref_scores[r, h, i] - kth) > rel_tol * scale:
                    return False
    return True


def test_quest_bound_is_upper_bound_of_true_group_score():
    """For every block: score >= max over its tokens of Σ_g q_g·k (the group's summed logit)."""
    bs, Hkv, G, D = 4, 2, 3, 16
    q, kmin, kmax, off, nb, keys = make_inputs(3, Hkv, G, D, [5, 1, 7], torch.float32, bs)
    s = score_blocks_ref(q, kmin, kmax, off, nb, G)
    qg = q.view(3, Hkv, G, D)
    for r in range(3):
        for b in range(int(nb[r])):
            tok = keys[(int(off[r]) + b) * bs:(int(off[r]) + b + 1) * bs]  # [bs, Hkv, D]
            true = torch.einsum("hgd,thd->th", qg[r], tok).amax(0)  # [Hkv]
            assert (s[r, :, b] >= true - 1e-4).all()
            # and the formula of DESIGN §3 step 3 term by term, for kv head 0
            blk = int(off[r]) + b
            lit = sum(max(qg[r, 0, g, i] * kmax[blk, 0, i], qg[r, 0, g, i] * kmin[blk, 0, i]).item()
                      for g in range(G) for i in range(D))
            assert abs(lit - s[r, 0, b].item()) < 1e-3


@pytest.mark.parametrize("G,D", [(1, 64), (3, 64), (4, 128)])
def test_torch_path_matches_ref(G, D):
    q, kmin, kmax, off, nb, _ = make_inputs(4, 2, G, D, [9, 0, 1, 20], torch.float32, seed=G)
    ws = torch.tensor([7, 0, 1, 18])
    for kw in [{}, dict(num_sink=1, window_start=ws)]:
        ref = score_blocks_ref(q, kmin, kmax, off, nb, G, 24, **kw)
        out = score_blocks_torch(q, kmin, kmax, off, nb, G, 24, **kw)
        assert ref.shape == (4, 2, 24) and ref.dtype == torch.float32
        assert rel_err(out, ref) < REL_TOL
    assert torch.isneginf(ref[1]).all() and torch.isfinite(ref[3, :, 1:18]).all()
    assert torch.isneginf(ref[3, :, 0]).all() and torch.isneginf(ref[3, :, 18:]).all()


def test_topk_blocks_padding_and_order():
    s = torch.tensor([[[3.0, 1.0, 2.0, float("-inf")]], [[float("-inf")] * 4]])
    ids, vals = topk_blocks(s, 6)
    assert ids.dtype == torch.int32 and ids.shape == (2, 1, 6)
    assert ids.tolist() == [[[0, 2, 1, -1, -1, -1]], [[-1] * 6]]
    assert vals[0, 0, :3].tolist() == [3.0, 2.0, 1.0] and torch.isneginf(vals[0, 0, 3:]).all()


def test_score_topk_cpu_dispatch():
    q, kmin, kmax, off, nb, _ = make_inputs(3, 2, 4, 64, [30, 2, 11], torch.float32)
    ids, vals = score_topk(q, kmin, kmax, off, nb, 4, k=8, max_blocks=32)
    assert topk_agrees(ids, score_blocks_ref(q, kmin, kmax, off, nb, 4, 32), 8)
    assert (ids[1, :, 2:] == -1).all()


# ------------------------------------------------------------- Triton under the interpreter

TRITON_CASES = {  # R, Hkv, G, D, num_blocks, dtype, extra kwargs
    "g1_d64_fp32": (3, 2, 1, 64, [5, 0, 37], torch.float32, {}),
    "g3_d64_fp16": (2, 3, 3, 64, [1, 40], torch.float16, {}),
    "g4_d128_fp32": (3, 2, 4, 128, [17, 33, 8], torch.float32, {}),
    "g4_d128_fp16_sink_window": (2, 2, 4, 128, [30, 12], torch.float16,
                                 dict(num_sink=2, window_start=[27, 12])),
}
MAX_BLOCKS, TILE, K = 40, 16, 6  # 3 tiles, the last partial


def run_interpreter_cases() -> dict:
    """Runs in the TRITON_INTERPRET=1 subprocess: per case, the relative score error and
    whether the top-K sets agree with the reference's (up to ties)."""
    from oasiskv.sparse.block_scores import score_blocks_triton, score_topk_triton
    results = {}
    for name, (R, Hkv, G, D, nbs, dtype, kw) in TRITON_CASES.items():
        q, kmin, kmax, off, nb, _ = make_inputs(R, Hkv, G, D, nbs, dtype, seed=len(name))
        if "window_start" in kw:
            kw = dict(kw, window_start=torch.tensor(kw["window_start"], dtype=torch.int32))
        ref = score_blocks_ref(q, kmin, kmax, off, nb, G, MAX_BLOCKS, **kw)
        out = score_blocks_triton(q, kmin, kmax, off, nb, G, MAX_BLOCKS, block_tile=TILE, **kw)
        ids, vals = score_topk_triton(q, kmin, kmax, off, nb, G, K, MAX_BLOCKS, block_tile=TILE, **kw)
        results[name] = {"rel_err": rel_err(out, ref), "topk_agree": topk_agrees(ids, ref, K),
                         "vals_match_scores": bool(torch.equal(
                             torch.where(ids >= 0, out.gather(2, ids.long().clamp_min(0)), vals), vals))}
    return results


@pytest.fixture(scope="module")
def interpreter_results():
    return run_under_interpreter(__file__)


@pytest.mark.parametrize("name", list(TRITON_CASES), ids=str)
def test_score_triton_interpreter(interpreter_results, name):
    res = interpreter_results[name]
    assert res["rel_err"] < REL_TOL and res["topk_agree"] and res["vals_match_scores"], res


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    print(json.dumps(run_interpreter_cases()))
