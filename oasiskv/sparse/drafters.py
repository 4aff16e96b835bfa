"""Where the lookahead token comes from (docs/design.md, "Drafters"). A drafter proposes
d_{t+1}, the token whose query predicts the blocks step t+1 needs; its K/V is never stored."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LOOKUP_MAX_N, LOOKUP_WINDOW = 3, 4096  # prompt lookup: n-grams up to 3 tokens, in the newest 4096


@dataclass(frozen=True, slots=True)
class Drafter:
    """What the engine needs to know of a drafter (`--drafter NAME`); it reads only these."""
    name: str
    # A draft row carries d_{t+1} through the model beside the real token (else the current
    # token's own query predicts, and the second row repeats the token).
    sends_draft_token: bool
    # A first pass of each step finds the draft (the oracle: the true next token), the step
    # decodes with it (`SparseDecodeStep.first_pass`).
    first_pass: bool = False
    # Blocks are retrieved with the current token's query before each layer's attention, on the
    # critical path, instead of predicted a step ahead (`LookaheadPipeline.on_demand`).
    retrieves_on_demand: bool = False
    runs_with_tensor_parallel: bool = True


_REGISTRY: dict[str, Drafter] = {}


def register(drafter: Drafter) -> None:
    _REGISTRY[drafter.name] = drafter


def drafter_named(name: str) -> Drafter:
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def drafter_names() -> list[str]:
    return list(_REGISTRY)


register(Drafter("self", sends_draft_token=True))
register(Drafter("ngram", sends_draft_token=True))
register(Drafter("prev", sends_draft_token=False))


class TokenHistory:
    """A request's tokens in a growing array: prompt lookup scans it in place, every step,
    without copying a Python list of the whole context."""

    def __init__(self, tokens: list[int]):
        self._buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self._buf[:len(tokens)] = tokens
        self._n = len(tokens)

    def append(self, token: int) -> None:
        if self._n == len(self._buf):
            self._buf = np.concatenate([self._buf, np.empty_like(self._buf)])
        self._buf[self._n] = token
        self._n += 1

    def tail(self, n: int) -> np.ndarray:
        return self._buf[max(0, self._n - n):self._n]


def ngram_propose(tokens: list[int] | TokenHistory, max_n: int = LOOKUP_MAX_N,
                  window: int = LOOKUP_WINDOW) -> int | None:
    """Prompt lookup: the token that followed the latest earlier occurrence of the newest
    n-gram (longest n first) in the request's own tokens."""
    h = tokens.tail(window) if isinstance(tokens, TokenHistory) else np.asarray(tokens[-window:], dtype=np.int64)
    L = len(h)
    for n in range(min(max_n, L - 1), 0, -1):
        # Starts i = 0 .. L-n-1 (a token follows each): h[i:i+n] equals the newest n tokens.
        match = np.ones(L - n, dtype=bool)
        for k in range(n):
            match &= h[k:k + L - n] == h[L - n + k]
        hits = np.flatnonzero(match)
        if hits.size:
            return int(h[hits[-1] + n])
    return None


def next_draft(drafter: str, tokens: list[int] | TokenHistory, previous_draft: int | None, sampled: int,
               draft_guess: int | None) -> int | None:
    """Draft for the step after `sampled` (the newest token, already appended to `tokens`).

    `self`: if the draft was right, the draft row saw the true context, and its own token
    (`draft_guess`: the argmax under greedy, a sample with the next position's noise under
    sampling) is the model's next token; while the chain is broken, fall back to prompt
    lookup (or the token itself).
    """
    if drafter == "self":
        if previous_draft == sampled and draft_guess is not None:
            return draft_guess
        return _proposal_or(tokens, sampled)
    if drafter == "ngram":
        return _proposal_or(tokens, sampled)
    return None  # no draft token, or one found another way (a first pass)


def _proposal_or(tokens, sampled: int) -> int:
    proposal = ngram_propose(tokens)
    return sampled if proposal is None else proposal
