"""The b-bit summary study's rounding (scripts/eval_summary_bits.py): each request's boxes move
out to its own per-channel grid, never in."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from eval_summary_bits import grid_boxes  # noqa: E402


def test_boxes_widen_onto_each_requests_grid():
    g = torch.Generator().manual_seed(0)
    lo = torch.randn(10, 2, 8, generator=g)
    hi = lo + torch.rand(10, 2, 8, generator=g)
    lo[6:] += 50  # the second request's keys sit far from the first's
    hi[6:] += 50
    offsets, counts, bits = torch.tensor([0, 6]), torch.tensor([6, 4]), 3
    qlo, qhi = grid_boxes(lo, hi, offsets, counts, bits)
    assert (qlo <= lo + 1e-5).all() and (qhi >= hi - 1e-5).all()
    for start, n in ((0, 6), (6, 4)):
        rows = slice(start, start + n)
        base = lo[rows].amin(0)
        step = (hi[rows].amax(0) - base) / (2 ** bits - 1)
        for q in (qlo[rows], qhi[rows]):
            j = (q - base) / step
            assert torch.allclose(j, j.round(), atol=1e-3) and j.min() >= -1e-3 and j.max() <= 2 ** bits - 1 + 1e-3
        # the extremes of the request's range are grid points, so they stay exact
        assert torch.allclose(qlo[rows].amin(0), base) and torch.allclose(qhi[rows].amax(0), hi[rows].amax(0))
