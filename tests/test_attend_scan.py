"""The working-set attention and the bounds scan in one launch (`sparse.attend_scan`) against
the two kernels launched apart, and both against the torch references, under Triton's CPU
interpreter (a subprocess, as tests/test_kernels.py does). Each program of the fused grid is
one of the separate kernels' programs, so its outputs must equal theirs exactly."""
from __future__ import annotations

import json
import os

import pytest
import torch
from test_block_scores import FP8_REL_TOL, abs_err, finite_max
from test_block_scores import make_inputs as make_scan_inputs
from test_kernels import TOL, make_decode_inputs
from triton_interpreter import run_under_interpreter

CASES = {  # B, Hkv, G, D, attention blocks, scan blocks per row, dtype, scan options
    "g4_d64_fp32": (2, 2, 4, 64, 5, [37, 12], torch.float32, dict(block_tile=16, tiles_per_program=1)),
    "g2_d128_fp16_two_tiles_sink_window": (3, 2, 2, 128, 4, [40, 0, 23], torch.float16,
                                           dict(block_tile=16, tiles_per_program=2, stages=2, num_sink=1,
                                                window_start=[36, 0, 20])),
    "g4_d64_fp16_fp8_summaries": (2, 2, 4, 64, 6, [30, 17], torch.float16,
                                  dict(block_tile=16, tiles_per_program=1, fp8=True)),
}
MAX_BLOCKS = 40


def run_interpreter_cases() -> dict:
    from oasiskv.kernels.paged_decode import paged_decode_triton
    from oasiskv.kernels.reference import paged_decode_ref
    from oasiskv.sparse.attend_scan import BoundsScan, attend_and_scan
    from oasiskv.sparse.block_scores import head_bounds_ref, head_bounds_triton
    from oasiskv.sparse.summaries import FP8, to_summary
    results = {}
    for name, (B, Hkv, G, D, blocks, scan_blocks, dtype, opts) in CASES.items():
        opts = dict(opts)
        args = make_decode_inputs(B, Hkv, G, 2, D, blocks, dtype, seed=len(name))
        dq, kmin, kmax, off, nb, _ = make_scan_inputs(B, Hkv, G, D, scan_blocks, dtype, seed=len(name) + 1)
        if opts.pop("fp8", False):
            kmin, kmax = to_summary(kmin, FP8), to_summary(kmax, FP8)
        ws = opts.pop("window_start", None)
        ws = torch.tensor(ws, dtype=torch.int32) if ws is not None else None
        sink = opts.pop("num_sink", 0)
        tile = opts["block_tile"]
        tiles = -(-MAX_BLOCKS // tile)

        def scan(poison):
            return BoundsScan(dq, kmin, kmax, off, nb, ws, sink,
                              torch.full((B, G * Hkv, MAX_BLOCKS), poison), torch.full((B, G * Hkv, tiles), poison),
                              tile, opts["tiles_per_program"], opts.get("stages", 3))

        fused_scan = scan(float("nan"))  # poisoned: every element must be written
        out = attend_and_scan(*args, D ** -0.5, fused_scan, out=torch.full_like(args[0], float("nan")))
        apart = scan(float("nan"))
        out_apart = paged_decode_triton(*args, D ** -0.5, num_splits=1)
        head_bounds_triton(dq, kmin, kmax, off, nb, G, MAX_BLOCKS, sink, ws, tile, out=apart.bounds,
                           tile_max=apart.tile_max, tiles_per_program=apart.tiles_per_program,
                           stages=apart.stages)
        ref_u = head_bounds_ref(dq, kmin, kmax, off, nb, G, MAX_BLOCKS, sink, ws)
        results[name] = {
            "attention_equal": bool(torch.equal(out, out_apart)),
            "bounds_equal": bool(torch.equal(fused_scan.bounds, apart.bounds)),
            "tile_max_equal": bool(torch.equal(fused_scan.tile_max, apart.tile_max)),
            "attention_err": (out.float() - paged_decode_ref(*args, D ** -0.5).float()).abs().max().item(),
            "bounds_rel_err": abs_err(fused_scan.bounds, ref_u) / finite_max(ref_u),
        }
    return results


@pytest.fixture(scope="module")
def interpreter_results():
    return run_under_interpreter(__file__)


@pytest.mark.parametrize("name", list(CASES), ids=str)
def test_attend_and_scan_equals_the_two_kernels(interpreter_results, name):
    res = interpreter_results[name]
    assert res["attention_equal"] and res["bounds_equal"] and res["tile_max_equal"], res
    assert res["attention_err"] < TOL[CASES[name][6]], res
    assert res["bounds_rel_err"] < (FP8_REL_TOL if CASES[name][7].get("fp8") else 1e-4), res


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    print(json.dumps(run_interpreter_cases()))
