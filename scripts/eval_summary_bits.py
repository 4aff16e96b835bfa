"""How much accuracy would b-bit block summaries cost? A CPU study for a storage format not
built (results: docs/results/*_4bit_summaries_study.json; fp8 summaries are what the engine stores).

The prediction's scan reads every block's min/max key summaries each decode step: at batch 16,
16K context, 1.2 GB a step in fp8 (256 B per block and kv head at D = 128). A 4-bit format
would store, per request, layer, kv head and channel, a fixed grid lo + s * j (j = 0 .. 15)
over the range the channel takes in the prompt, and per block the grid index just below its min and just above its max:
the box only widens, and a channel with a large offset keeps its resolution (where fp8's
relative rounding does not).

Here the engine's summaries stay exact; the CPU scorer (`block_scores.score_blocks_torch`, which
both the pipeline and the in-line path call on CPU) quantizes them that way before it scores.
Rounding is monotone, so the min of rounded keys is the rounded min: scoring rounded summaries
is scoring what the format would store. The grid is taken over each request's blocks at score
time, so it also covers the ~200 decode tokens an eval adds to a 6,000-token prompt; a stored
format would clamp those to the prompt's grid.

    .venv/bin/python scripts/eval_summary_bits.py --bits 4 eval fidelity --context-len 6000 ...
    .venv/bin/python scripts/eval_summary_bits.py --bits 4 eval passkey --context-len 4000 ...

Everything after --bits is an `oasiskv` command line; run it without --summary-dtype (the
exact summaries are what gets quantized).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from oasiskv.entrypoints import cli
from oasiskv.sparse import block_scores


def grid_boxes(kmin: torch.Tensor, kmax: torch.Tensor, block_offsets: torch.Tensor, num_blocks: torch.Tensor,
               bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kmin, kmax [total_blocks, Hkv, D] -> float32 copies where each request's blocks (rows
    block_offsets[r] .. + num_blocks[r]) are moved out to its per-channel grid of 2**bits
    points: min down, max up."""
    lo_out, hi_out = kmin.float().clone(), kmax.float().clone()
    levels = 2 ** bits - 1
    for start, n in zip(block_offsets.tolist(), num_blocks.tolist()):
        if n <= 0:
            continue
        rows = slice(start, start + n)
        lo, hi = lo_out[rows], hi_out[rows]
        base = lo.amin(0)
        step = (hi.amax(0) - base).clamp_min(1e-6) / levels
        lo_out[rows] = base + torch.floor((lo - base) / step).clamp(0, levels) * step
        hi_out[rows] = base + torch.ceil((hi - base) / step).clamp(0, levels) * step
    return lo_out, hi_out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bits", type=int, required=True, help="grid points per channel: 2**bits")
    args, rest = ap.parse_known_args()
    exact = block_scores.score_blocks_torch

    def quantized(q, kmin, kmax, block_offsets, num_blocks, *more, **kw):
        lo, hi = grid_boxes(kmin, kmax, block_offsets, num_blocks, args.bits)
        return exact(q, lo, hi, block_offsets, num_blocks, *more, **kw)

    block_scores.score_blocks_torch = quantized  # score_topk looks it up at each call
    rc = cli.main(rest)
    if rc == 0 and "--output-json" in rest:
        mark_json(rest[rest.index("--output-json") + 1], args.bits)
    return rc


def mark_json(path: str, bits: int) -> None:
    """The eval's JSON says summary_dtype auto (what the engine stored): record what was scored."""
    with open(path) as f:
        res = json.load(f)
    res["summary_grid_bits"] = bits  # scored as `grid_boxes` of the exact summaries
    with open(path, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
