"""The lookahead drafts of pipeline rows, chosen on the device (docs/design.md, "Drafters"):
the same rules as `drafters.next_draft` (`self`: the draft row's own guess while the chain
holds, else prompt lookup, else the token), computed from each row's newest tokens kept on the device. The next
step's inputs then never wait for the host, so a sparse step can be launched before the last
one's tokens are read (async scheduling), and no step scans Python lists.
"""
from __future__ import annotations

import torch

from oasiskv.kernels import draft_lookup
from oasiskv.sparse.drafters import LOOKUP_MAX_N

# On CUDA the rule runs as one kernel (`kernels.draft_lookup`) instead of ~50 small torch launches.
LOOKUP_KERNEL = True


def propose(history: torch.Tensor, lengths: torch.Tensor, max_n: int = LOOKUP_MAX_N):
    """`drafters.ngram_propose` for every row at once. history [B, W] int64: each row's newest
    tokens right-aligned (the left is padding); lengths [B]: how many are real (<= W).
    Returns (proposal [B] int64, found [B] bool)."""
    B, W = history.shape
    proposal = torch.full((B,), -1, dtype=torch.long, device=history.device)
    found = torch.zeros(B, dtype=torch.bool, device=history.device)
    for n in range(max_n, 0, -1):  # the longest n-gram that matches wins
        if W - n <= 0:
            continue
        start = torch.arange(W - n, device=history.device)
        match = start[None, :] >= (W - lengths)[:, None]  # starts among the real tokens only
        for k in range(n):  # h[i + k] == the k-th of the newest n tokens
            match &= history[:, k:k + W - n] == history[:, W - n + k:W - n + k + 1]
        hit = match.any(1) & (lengths - 1 >= n)
        latest = torch.where(match, start[None, :], -1).amax(1)
        follower = history.gather(1, (latest + n).clamp(0, W - 1)[:, None])[:, 0]
        proposal = torch.where(hit & ~found, follower, proposal)
        found |= hit
    return proposal, found


def next_drafts(drafter: str, history: torch.Tensor, lengths: torch.Tensor, drafts: torch.Tensor,
                tokens: torch.Tensor, guesses: torch.Tensor) -> torch.Tensor:
    """The drafts of the next step [B], `drafters.next_draft` on the device. history / lengths
    already hold `tokens` (this step's samples); drafts: the ones this step ran with; guesses:
    the draft rows' own tokens."""
    if drafter not in ("self", "ngram"):
        return tokens  # prev / ondemand run no draft: the row repeats the token
    if LOOKUP_KERNEL and history.is_cuda and draft_lookup.triton is not None:
        return draft_lookup.draft_lookup(drafter, history, lengths, drafts, tokens, guesses, LOOKUP_MAX_N)
    proposal, found = propose(history, lengths)
    fallback = torch.where(found, proposal, tokens)
    if drafter == "ngram":
        return fallback
    return torch.where(drafts == tokens, guesses, fallback)


def append(history: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor):
    """Add one token to each of `rows` (in place): the window shifts left by one. Returns the
    rows' new windows and lengths."""
    h = history[rows]
    h = torch.cat([h[:, 1:], tokens[:, None].to(h.dtype)], 1)
    n = (lengths[rows] + 1).clamp_max(history.shape[1])
    history[rows], lengths[rows] = h, n
    return h, n
