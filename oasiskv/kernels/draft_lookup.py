"""The next lookahead drafts of pipeline rows in one launch: prompt lookup over each row's newest
tokens (`device_drafts.propose`, the longest n-gram first) and the drafter's rule on top
(`device_drafts.next_drafts`). The torch version launches ~50 small kernels a step; this one
program per row reads its window once per n-gram length.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch version runs
    triton = None

BLOCK = 1024  # window positions a tile

if triton is not None:

    @triton.jit
    def _draft_lookup_kernel(hist_ptr, len_ptr, drafts_ptr, tokens_ptr, guesses_ptr, out_ptr, stride_h,
                             W: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr, SELF: tl.constexpr):
        """Row r: for n = MAX_N .. 1, the latest start s among the real tokens whose n tokens
        equal the newest n; the first n that has one proposes the token after it. `self` keeps
        the draft row's guess while the last draft was right."""
        r = tl.program_id(0)
        row = hist_ptr + r * stride_h
        length = tl.load(len_ptr + r)
        token = tl.load(tokens_ptr + r)
        proposal = token
        found = length < 0  # False, as a tensor
        for n in tl.static_range(MAX_N, 0, -1):
            best = tl.max(tl.full((BLOCK,), -1, tl.int32), 0)
            for off in range(0, W, BLOCK):
                s = off + tl.arange(0, BLOCK)
                m = (s < W - n) & (s >= W - length)
                for k in tl.static_range(n):
                    hk = tl.load(row + s + k, mask=m, other=-1)
                    m = m & (hk == tl.load(row + W - n + k))
                best = tl.maximum(best, tl.max(tl.where(m, s, -1), 0))
            hit = (best >= 0) & ~found  # (a start at all means length > n)
            follower = tl.load(row + tl.maximum(best, 0) + n, mask=hit, other=0)
            proposal = tl.where(hit, follower, proposal)
            found = found | hit
        if SELF:
            right = tl.load(drafts_ptr + r) == token
            proposal = tl.where(right, tl.load(guesses_ptr + r), proposal)
        tl.store(out_ptr + r, proposal)


def draft_lookup(drafter: str, history: torch.Tensor, lengths: torch.Tensor, drafts: torch.Tensor,
                 tokens: torch.Tensor, guesses: torch.Tensor, max_n: int) -> torch.Tensor:
    """`device_drafts.next_drafts` for `self` and `ngram` on CUDA: history [B, W] int64 (each
    row's newest tokens right-aligned), lengths [B]; drafts, tokens, guesses [B] -> drafts [B]."""
    B, W = history.shape
    out = torch.empty(B, dtype=torch.long, device=history.device)
    if B:
        _draft_lookup_kernel[(B,)](history, lengths, drafts, tokens, guesses, out, history.stride(0),
                                   W=W, MAX_N=max_n, BLOCK=min(BLOCK, triton.next_power_of_2(W)),
                                   SELF=drafter == "self", num_warps=4)
    return out
