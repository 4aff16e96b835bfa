"""The drafts' lookup kernel (oasiskv/kernels/draft_lookup.py) on a GPU at the engine's shape
(48 rows, a 4,096-token window): equal to the torch rule for `self` and `ngram` over small and
real vocabularies, then both timed (triton.testing.do_bench, median us).

    PYTHONPATH=. python3 scripts/gpu_check_draft_lookup.py
"""
import json

import torch
import triton

from oasiskv.kernels.draft_lookup import draft_lookup
from oasiskv.sparse import device_drafts
from oasiskv.sparse.drafters import LOOKUP_MAX_N, LOOKUP_WINDOW


def main(B: int = 48, W: int = LOOKUP_WINDOW) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    device_drafts.LOOKUP_KERNEL = False  # next_drafts: the torch rule
    res = {}
    for vocab in (3, 50, 151_000):  # small vocabularies repeat n-grams
        lengths = torch.randint(1, W + 1, (B,), device="cuda", generator=g)
        h = torch.randint(0, vocab, (B, W), device="cuda", generator=g)
        h = torch.where(torch.arange(W, device="cuda")[None] >= W - lengths[:, None], h, -1)
        tokens = torch.randint(0, vocab, (B,), device="cuda", generator=g)
        drafts = torch.where(torch.rand(B, device="cuda", generator=g) < 0.5, tokens, tokens + 1)
        guesses = torch.randint(0, vocab, (B,), device="cuda", generator=g)
        args = (h, lengths, drafts, tokens, guesses)
        for d in ("self", "ngram"):
            same = torch.equal(draft_lookup(d, *args, LOOKUP_MAX_N), device_drafts.next_drafts(d, *args))
            res[f"{d} vocab {vocab}"] = "PASS" if same else "FAIL"
        res[f"us kernel / torch, vocab {vocab}"] = (
            round(1e3 * triton.testing.do_bench(lambda: draft_lookup("self", *args, LOOKUP_MAX_N)), 1),
            round(1e3 * triton.testing.do_bench(lambda: device_drafts.next_drafts("self", *args)), 1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
