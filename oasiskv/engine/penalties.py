"""The per-request rules between the model's logits and temperature (vLLM's meanings):
min_tokens, logit_bias, then the repetition, frequency and presence penalties.

Each works on one request's row [V]; the sampler applies them row by row, so a request's
fault stays its own. The penalties need the request's tokens so far: `TokenCounts` keeps its
output-token counts on the device, brought up to date with the tokens added since."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenCounts:
    """A request's generated-token counts [V] and (for the repetition penalty) which tokens
    its prompt holds [V], on the logits' device."""
    counts: torch.Tensor
    in_prompt: torch.Tensor
    counted: int = 0  # output tokens already in `counts`

    @classmethod
    def of(cls, seq, vocab: int, dev: torch.device) -> "TokenCounts":
        state = seq.token_counts
        if state is None:
            in_prompt = torch.zeros(vocab, dtype=torch.bool, device=dev)
            in_prompt[torch.tensor(seq.prompt_token_ids, device=dev)] = True
            state = seq.token_counts = cls(torch.zeros(vocab, device=dev), in_prompt)
        new = seq.output_token_ids[state.counted:]
        if new:
            if min(new) < 0:  # a token still on the device (async scheduling) must never be counted
                raise ValueError("penalties need every earlier token on the host")
            ids = torch.tensor(new, device=dev)
            state.counts.index_put_((ids,), torch.ones(len(new), device=dev), accumulate=True)
            state.counted += len(new)
        return state


def apply_rules(row: torch.Tensor, seq, appended: torch.Tensor | None = None) -> torch.Tensor:
    """`seq`'s min_tokens mask, logit bias and penalties on its logits row [V] (float32), as a
    new row. appended: a token (0-d tensor) taken as already generated after the request's
    tokens: a lookahead draft row's logits are for the position after it."""
    p = seq.params
    row = row.clone()
    generated = len(seq.output_token_ids) + (appended is not None)
    if generated < p.min_tokens and seq.min_tokens_stop_ids:
        row[torch.tensor(seq.min_tokens_stop_ids, device=row.device)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=row.device)
        row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device))
    if p.has_penalties:
        state = TokenCounts.of(seq, row.shape[0], row.device)
        counts = state.counts
        if appended is not None:
            counts = counts.clone()
            counts[appended.view(1)] += 1
        row = penalize(row, counts, state.in_prompt, p.presence_penalty, p.frequency_penalty,
                       p.repetition_penalty)
    return row


def penalize(row: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, presence: float,
             frequency: float, repetition: float) -> torch.Tensor:
    """vLLM's penalties on a row [V]: counts [V] are the generated tokens' occurrences."""
    if repetition != 1:
        seen = in_prompt | (counts > 0)
        row = torch.where(seen, torch.where(row > 0, row / repetition, row * repetition), row)
    return row - frequency * counts - presence * (counts > 0).to(row.dtype)
