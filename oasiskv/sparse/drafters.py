"""Where the lookahead token comes from (DESIGN §4). A drafter proposes d_{t+1}, the token
whose query predicts the blocks step t+1 needs; its K/V is never stored."""
from __future__ import annotations

# Drafters that send a draft token through the model alongside the real one.
USES_DRAFT_TOKEN = {"self", "ngram", "oracle"}


def ngram_propose(tokens: list[int], max_n: int = 3, window: int = 4096) -> int | None:
    """Prompt lookup: the token that followed the latest earlier occurrence of the newest
    n-gram (longest n first) in the request's own tokens."""
    hist = tokens[-window:]
    for n in range(min(max_n, len(hist) - 1), 0, -1):
        tail = hist[-n:]
        for i in range(len(hist) - n - 1, -1, -1):
            if hist[i:i + n] == tail:
                return hist[i + n]
    return None


def next_draft(drafter: str, tokens: list[int], previous_draft: int | None, sampled: int,
               draft_argmax: int | None) -> int | None:
    """Draft for the step after `sampled` (the newest token, already appended to `tokens`).

    `self`: the draft position's own argmax is the model's greedy next token if the draft was
    right; while the chain is broken, fall back to prompt lookup (or the token itself).
    """
    if drafter == "self":
        if previous_draft == sampled and draft_argmax is not None:
            return draft_argmax
        return ngram_propose(tokens) or sampled
    if drafter == "ngram":
        return ngram_propose(tokens) or sampled
    return None  # prev / ondemand send no draft; oracle sets it by an extra pass
