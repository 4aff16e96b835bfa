"""Block scores (oasiskv/sparse/block_scores.py, their kernels in oasiskv/kernels/block_bounds.py
and block_select.py): the reference against brute force over the tokens, the torch path against
the reference, top-K, and the Triton kernels against the reference under Triton's CPU
interpreter (in a subprocess, as tests/kernels/test_kernels.py does: TRITON_INTERPRET must be set before
triton is imported). Interpreter cases use float32/float16 only (CONTRIBUTING.md); bf16 is
checked on the GPU by scripts/gpu_check_sparse.py."""
from __future__ import annotations

import json
import os

import pytest
import torch
from triton_interpreter import run_under_interpreter

from oasiskv.kernels.block_bounds import COMBINES, RANGE_WEIGHT
from oasiskv.sparse.block_scores import (combine_heads, head_bounds_ref, score_blocks_ref, score_blocks_torch,
                                         score_topk, topk_blocks)
from oasiskv.sparse.summaries import block_minmax

pytestmark = pytest.mark.slow

# Bounds are float32 sums of 2·D products in every path; only the order differs, so the gap
# is float32 rounding: 1e-5 of the largest |bound| (~10..100 here). Combined scores (a sum, or a
# bound minus the head's best) carry that same absolute error, so they are held to it too.
REL_TOL = 1e-5
FP8_REL_TOL = 1e-2  # fp8 summaries: the kernel's query is split into two e4m3 numbers (~2^-8 relative)


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


def abs_err(a, b):
    """Max |a - b| over finite entries; requires the -inf entries to coincide."""
    assert torch.equal(torch.isneginf(a), torch.isneginf(b))
    fin = torch.isfinite(b)
    return (a - b).abs()[fin].max().item() if fin.any() else 0.0


def finite_max(x):
    fin = torch.isfinite(x)
    return x.abs()[fin].max().item() if fin.any() else 1.0


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


def test_range_weight_one_is_the_quest_bound_of_each_heads_logit():
    """At α = 1, for every block and query head: score >= max over its tokens of q_g·k, and the
    formula of block_scores' docstring term by term."""
    bs, Hkv, G, D = 4, 2, 3, 16
    q, kmin, kmax, off, nb, keys = make_inputs(3, Hkv, G, D, [5, 1, 7], torch.float32, bs)
    u = head_bounds_ref(q, kmin, kmax, off, nb, G, range_weight=1.0)  # [R, Hq, M]
    for r in range(3):
        for b in range(int(nb[r])):
            tok = keys[(int(off[r]) + b) * bs:(int(off[r]) + b + 1) * bs]  # [bs, Hkv, D]
            true = torch.einsum("hgd,thd->thg", q[r].view(Hkv, G, D), tok).amax(0)  # [Hkv, G]
            assert (u[r, :, b] >= true.reshape(-1) - 1e-4).all()
            blk = int(off[r]) + b
            for head in (0, G + 1):  # the first head of kv head 0, the second of kv head 1
                h = head // G
                lit = sum(max(q[r, head, i] * kmax[blk, h, i], q[r, head, i] * kmin[blk, h, i]).item()
                          for i in range(D))
                assert abs(lit - u[r, head, b].item()) < 1e-3


def test_range_weight_zero_is_the_box_centre_and_scores_are_linear_in_it():
    q, kmin, kmax, off, nb, _ = make_inputs(2, 2, 3, 16, [6, 4], torch.float32)
    at = lambda a: head_bounds_ref(q, kmin, kmax, off, nb, 3, 6, range_weight=a)
    centre = ((kmin + kmax) / 2)[:6]  # sequence 0's blocks
    want = torch.einsum("hgd,bhd->hgb", q[0].view(2, 3, 16), centre).reshape(6, 6)
    assert torch.allclose(at(0.0)[0], want, atol=1e-4)
    assert torch.allclose(at(RANGE_WEIGHT), (1 - RANGE_WEIGHT) * at(0.0) + RANGE_WEIGHT * at(1.0),
                          atol=1e-4)


def test_combines():
    """shifted_max: max over the group of each head's bound minus its best block's; sum: the
    group sum (an upper bound of the group's summed logit). Rows without blocks stay -inf."""
    q, kmin, kmax, off, nb, _ = make_inputs(3, 2, 3, 16, [6, 0, 4], torch.float32)
    u = head_bounds_ref(q, kmin, kmax, off, nb, 3, 8)
    per = u.view(3, 2, 3, 8)
    assert torch.equal(combine_heads(u, 3, "sum"), per.sum(2))
    s = combine_heads(u, 3, "shifted_max")
    assert torch.isneginf(s[1]).all() and torch.isneginf(s[:, :, 6:]).all()
    for r in (0, 2):
        for h in range(2):
            n = int(nb[r])
            want = (per[r, h, :, :n] - per[r, h, :, :n].amax(-1, keepdim=True)).amax(0)
            assert torch.allclose(s[r, h, :n], want) and s[r, h, :n].max() == 0
    with pytest.raises(ValueError, match="unknown combine"):
        combine_heads(u, 3, "mean")


def test_shifted_max_keeps_a_sharp_heads_block():
    """Why the default is not the sum: a broad head with large bounds everywhere outvotes a head
    that points at one block; with the shift each head's best block ranks first."""
    D, M = 4, 6
    kmin = torch.zeros(M, 1, D)
    kmax = torch.zeros(M, 1, D)
    kmax[:, 0, 0] = torch.tensor([50.0, 40, 30, 20, 10, 0])  # the broad head reads dim 0
    kmax[5, 0, 1] = 3.0  # block 5 stands out only along the sharp head's dim 1
    q = torch.tensor([[[1.0, 0, 0, 0], [0, 1.0, 0, 0]]])  # [R=1, G=2, D]
    args = (q, kmin, kmax, torch.tensor([0]), torch.tensor([M]), 2)
    top = lambda c: set(score_topk(*args, k=2, max_blocks=M, combine=c)[0][0, 0].tolist())
    assert top("sum") == {0, 1}
    assert top("shifted_max") == {0, 5}


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("G,D", [(1, 64), (3, 64), (4, 128)])
def test_torch_path_matches_ref(G, D, combine):
    q, kmin, kmax, off, nb, _ = make_inputs(4, 2, G, D, [9, 0, 1, 20], torch.float32, seed=G)
    ws = torch.tensor([7, 0, 1, 18])
    for kw in [{}, dict(range_weight=1.0), dict(num_sink=1, window_start=ws)]:  # ref: the last
        ref = score_blocks_ref(q, kmin, kmax, off, nb, G, 24, combine=combine, **kw)
        out = score_blocks_torch(q, kmin, kmax, off, nb, G, 24, combine=combine, **kw)
        scale = head_bounds_ref(q, kmin, kmax, off, nb, G, 24, range_weight=1.0)
        assert ref.shape == (4, 2, 24) and ref.dtype == torch.float32
        assert abs_err(out, ref) < REL_TOL * finite_max(scale)
    assert torch.isneginf(ref[1]).all() and torch.isfinite(ref[3, :, 1:18]).all()
    assert torch.isneginf(ref[3, :, 0]).all() and torch.isneginf(ref[3, :, 18:]).all()


def test_topk_blocks_padding_and_order():
    s = torch.tensor([[[3.0, 1.0, 2.0, float("-inf")]], [[float("-inf")] * 4]])
    ids, vals = topk_blocks(s, 6)
    assert ids.dtype == torch.int32 and ids.shape == (2, 1, 6)
    assert ids.tolist() == [[[0, 2, 1, -1, -1, -1]], [[-1] * 6]]
    assert vals[0, 0, :3].tolist() == [3.0, 2.0, 1.0] and torch.isneginf(vals[0, 0, 3:]).all()


@pytest.mark.parametrize("combine", COMBINES)
def test_score_topk_cpu_dispatch(combine):
    q, kmin, kmax, off, nb, _ = make_inputs(3, 2, 4, 64, [30, 2, 11], torch.float32)
    ids, vals = score_topk(q, kmin, kmax, off, nb, 4, k=8, max_blocks=32, combine=combine)
    assert topk_agrees(ids, score_blocks_ref(q, kmin, kmax, off, nb, 4, 32, combine=combine), 8)
    assert (ids[1, :, 2:] == -1).all()


def packed_rows(L=3, Hkv=2, G=4, D=64, mb=24, dtype=torch.float32, seed=3):
    """A conversion's layout: L rows of `mb` blocks back to back (no gap), each filled up to
    its own `num_blocks`; the last row's wider scan would run past the tensor's end."""
    gen = torch.Generator().manual_seed(seed)
    kmin, kmax = block_minmax(torch.randn(L * mb * 4, Hkv, D, generator=gen).to(dtype), 4)
    q = torch.randn(L, G * Hkv, D, generator=gen).to(dtype)
    off = torch.arange(L) * mb
    nb = torch.tensor([mb, 9, 17][:L])
    return q, kmin, kmax, off, nb, dict(num_sink=1, window_start=nb - 2)


def test_a_wider_scan_picks_the_same_blocks():
    """The conversion scans one width for every request (`SparseManager.scan_blocks`): blocks
    past a row's end score -inf, so a scan wider than the rows' spacing picks what the exact one does."""
    q, kmin, kmax, off, nb, kw = packed_rows()
    exact = score_topk(q, kmin, kmax, off, nb, 4, k=8, max_blocks=24, **kw)
    wide = score_topk(q, kmin, kmax, off, nb, 4, k=8, max_blocks=100, **kw)
    assert torch.equal(exact[0], wide[0]) and torch.equal(exact[1], wide[1])


# ------------------------------------------------------------- Triton under the interpreter

TRITON_CASES = {  # R, Hkv, G, D, num_blocks, dtype, extra kwargs
    "g1_d64_fp32": (3, 2, 1, 64, [5, 0, 37], torch.float32, {}),
    "g3_d64_fp16": (2, 3, 3, 64, [1, 40], torch.float16, {}),
    "g4_d128_fp32": (3, 2, 4, 128, [17, 33, 8], torch.float32, {}),
    "g4_d128_fp16_sink_window": (2, 2, 4, 128, [30, 12], torch.float16,
                                 dict(num_sink=2, window_start=[27, 12])),
    "g3_d64_fp32_quest_bound": (2, 2, 3, 64, [33, 9], torch.float32, dict(range_weight=1.0)),
    # The bounds kernel's default walks all 3 tiles in one program; here two tiles per program,
    # loads two deep (the last program's second tile is past the end).
    "g4_d128_fp16_2_tiles_per_program": (2, 2, 4, 128, [40, 23], torch.float16,
                                         dict(tiles_per_program=2, stages=2)),
    # fp8 summaries (`--summary-dtype fp8`): fp8 products, the query split in two e4m3 parts.
    "g4_d128_fp16_fp8_summaries": (3, 2, 4, 128, [17, 40, 8], torch.float16, dict(fp8=True)),
    "g3_d64_fp32_fp8_summaries_sink_window": (2, 3, 3, 64, [30, 12], torch.float32,
                                              dict(fp8=True, num_sink=2, window_start=[27, 12])),
    # As the page pool holds them (`summary_arena`): each block's min and max side by side.
    "g4_d128_fp16_fp8_summaries_pool_views": (3, 2, 4, 128, [17, 40, 8], torch.float16,
                                              dict(fp8=True, pool_views=True)),
}
MAX_BLOCKS, TILE, K = 40, 16, 6  # 3 tiles, the last partial


def run_interpreter_cases() -> dict:
    """Runs in the TRITON_INTERPRET=1 subprocess: per case, the kernel's per-head bounds and
    each combine's scores against the reference (error relative to the bounds' scale), and
    whether the top-K sets agree with the reference's (up to ties)."""
    from oasiskv.kernels.block_bounds import head_bounds_triton, score_blocks_triton
    from oasiskv.kernels.block_select import score_select_triton
    from oasiskv.sparse.block_scores import score_topk_triton
    from oasiskv.kernels.summary_fold import FP8, to_summary
    results = {}
    for name, (R, Hkv, G, D, nbs, dtype, kw) in TRITON_CASES.items():
        q, kmin, kmax, off, nb, _ = make_inputs(R, Hkv, G, D, nbs, dtype, seed=len(name))
        kw = dict(kw)
        fp8 = kw.pop("fp8", False)
        if fp8:
            kmin, kmax = to_summary(kmin, FP8), to_summary(kmax, FP8)
        if kw.pop("pool_views", False):
            both = torch.stack([kmin, kmax], 1)
            kmin, kmax = both[:, 0], both[:, 1]
        tol = FP8_REL_TOL if fp8 else 1e-4  # near-ties, relative to the largest score
        if "window_start" in kw:
            kw = dict(kw, window_start=torch.tensor(kw["window_start"], dtype=torch.int32))
        tuning = {k: kw.pop(k) for k in ("tiles_per_program", "stages") if k in kw}  # bounds + select only
        ref_u = head_bounds_ref(q, kmin, kmax, off, nb, G, MAX_BLOCKS, **kw)
        u = head_bounds_triton(q, kmin, kmax, off, nb, G, MAX_BLOCKS, block_tile=TILE, **kw, **tuning)
        scale = finite_max(ref_u)
        res = {"bounds_rel_err": abs_err(u, ref_u) / scale}
        for combine in COMBINES:
            ref = score_blocks_ref(q, kmin, kmax, off, nb, G, MAX_BLOCKS, combine=combine, **kw)
            out = score_blocks_triton(q, kmin, kmax, off, nb, G, MAX_BLOCKS, block_tile=TILE,
                                      combine=combine, **kw)
            ids, vals = score_topk_triton(q, kmin, kmax, off, nb, G, K, MAX_BLOCKS, block_tile=TILE,
                                          combine=combine, **kw)
            res[combine] = {"rel_err": abs_err(out, ref) / scale,
                            "topk_agree": topk_agrees(ids, ref, K, tol),
                            "vals_match_scores": bool(torch.equal(
                                torch.where(ids >= 0, out.gather(2, ids.long().clamp_min(0)), vals), vals))}
        # The fused combine + select (shifted max): the same set, each id with its score.
        ref = score_blocks_ref(q, kmin, kmax, off, nb, G, MAX_BLOCKS, **kw)
        for k in (K, MAX_BLOCKS + 3):  # also more than the row has: -1 / -inf padding
            ids, vals = score_select_triton(q, kmin, kmax, off, nb, G, k, MAX_BLOCKS, block_tile=TILE, **kw,
                                            **tuning)
            got = ref.gather(2, ids.long().clamp_min(0))
            res[f"select_k{k}"] = {"topk_agree": topk_agrees(ids, ref, k, tol),
                                   "vals_match_scores": bool(torch.allclose(
                                       torch.where(ids >= 0, got, vals), vals, rtol=1e-5, atol=tol * scale)),
                                   "padding": bool(((ids < 0) == (vals == float("-inf"))).all())}
        results[name] = res
    q, kmin, kmax, off, nb, kw = packed_rows(dtype=torch.float16)
    exact = score_topk_triton(q, kmin, kmax, off, nb, 4, K, 24, block_tile=TILE, **kw)
    wide = score_topk_triton(q, kmin, kmax, off, nb, 4, K, 100, block_tile=TILE, **kw)
    results["wider_scan_same_blocks"] = bool(torch.equal(exact[0], wide[0]) and torch.equal(exact[1], wide[1]))
    results["select_digits"] = select_digit_widths_agree()
    results["skip_dead_tiles"] = dead_tiles_skipped_agree()
    return results


def dead_tiles_skipped_agree() -> dict:
    """The bounds kernel with the tiles past each row's end skipped: the same bounds and tile
    maxima, bit for bit, for rows empty, short, past a program's tiles and cut by a window, in
    bf16 and fp8 summaries."""
    from oasiskv.kernels import block_bounds
    from oasiskv.kernels.summary_fold import FP8, to_summary
    q, kmin, kmax, off, nb, _ = make_inputs(4, 2, 2, 16, [37, 0, 150, 9], torch.bfloat16, seed=9)
    out, saved = {}, block_bounds.BOUNDS_SKIP_DEAD_TILES
    for name, (lo, hi, kw) in {"bf16": (kmin, kmax, {}),
                               "fp8_window": (to_summary(kmin, FP8, -1), to_summary(kmax, FP8, 1),
                                              dict(window_start=torch.tensor([30, 0, 70, 9], dtype=torch.int32)))}.items():
        runs = []
        for skip in (False, True):
            block_bounds.BOUNDS_SKIP_DEAD_TILES = skip
            tile_max = torch.full((4, 4, 13), 7.0)
            u = block_bounds.head_bounds_triton(q, lo, hi, off, nb, 2, 200, num_sink=1, block_tile=16,
                                                tiles_per_program=2, tile_max=tile_max, **kw)
            runs.append((u, tile_max))
        block_bounds.BOUNDS_SKIP_DEAD_TILES = saved
        out[name] = bool(torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]))
    return out


def select_digit_widths_agree() -> dict:
    """The select's threshold search 1, 2, 4 or 8 bits a pass: the same blocks and scores, in the
    same order, on scores full of ties (small integer keys and queries) and negatives, for a k
    below, at and above the rows' lengths."""
    from oasiskv.kernels import block_select
    q, kmin, kmax, off, nb, keys = make_inputs(3, 2, 2, 16, [37, 9, 40], torch.float32, seed=5)
    kmin, kmax = block_minmax(keys.round().clamp(-2, 2), 4)
    q = q.round().clamp(-1, 1)
    saved = block_select.SELECT_DIGIT_BITS, block_select.SELECT_MAX_COMPARES
    out = {}
    try:
        block_select.SELECT_MAX_COMPARES = 1 << 30
        for k in (5, 9, 40, 43):
            runs = {}
            for bits in (1, 2, 4, 8):
                block_select.SELECT_DIGIT_BITS = bits
                runs[bits] = block_select.score_select_triton(q, kmin, kmax, off, nb, 2, k, 40, block_tile=16)
            out[f"k{k}"] = all(torch.equal(runs[1][0], r[0]) and torch.equal(runs[1][1], r[1]) for r in runs.values())
            if k == 9:  # ties among the chosen scores (so the cut falls inside a run of equal keys)
                out["ties"] = any(len(set(v[v > float("-inf")].tolist())) < int((v > float("-inf")).sum())
                                  for v in runs[1][1].flatten(0, 1))
        block_select.SELECT_DIGIT_BITS, block_select.SELECT_MAX_COMPARES = 4, 16384
        out["bits_on_wide_rows"] = [block_select.select_digit_bits(m) for m in (512, 1024, 2048, 8192, 32768)]
    finally:
        block_select.SELECT_DIGIT_BITS, block_select.SELECT_MAX_COMPARES = saved
    return out


@pytest.fixture(scope="module")
def interpreter_results():
    return run_under_interpreter(__file__)
@pytest.mark.parametrize("name", list(TRITON_CASES), ids=str)
def test_score_triton_interpreter(interpreter_results, name):
    res = interpreter_results[name]
    tol = FP8_REL_TOL if TRITON_CASES[name][6].get("fp8") else REL_TOL
    assert res["bounds_rel_err"] < tol, res
    for combine in COMBINES:
        c = res[combine]
        assert c["rel_err"] < tol and c["topk_agree"] and c["vals_match_scores"], res
    for k in (K, MAX_BLOCKS + 3):
        assert all(res[f"select_k{k}"].values()), res


def test_a_wider_scan_picks_the_same_blocks_triton(interpreter_results):
    assert interpreter_results["wider_scan_same_blocks"]


def test_bounds_skipping_dead_tiles_triton(interpreter_results):
    assert all(interpreter_results["skip_dead_tiles"].values()), interpreter_results["skip_dead_tiles"]


def test_select_threshold_search_any_digit_width_triton(interpreter_results):
    res = interpreter_results["select_digits"]
    assert all(res[f"k{k}"] for k in (5, 9, 40, 43)) and res["ties"], res
    assert res["bits_on_wide_rows"] == [4, 4, 2, 1, 1], res


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    print(json.dumps(run_interpreter_cases()))
