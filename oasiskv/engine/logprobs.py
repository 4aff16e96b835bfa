"""Log-probabilities a request asks for: of each sampled token and of each prompt token, with
the top-n alternatives, from the model's raw logits in float32 (before penalties, bias and
temperature: vLLM v1's default "raw" logprobs)."""
from __future__ import annotations

import torch

PROMPT_ROWS_AT_ONCE = 512  # prompt logprobs are computed this many positions at a time


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: list[int]) -> list[dict[int, float]]:
    """logits [B, V], the chosen tokens [B] -> per row {token: logprob} holding the chosen token
    and the row's top-`top_n[i]` tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.view(-1, 1).long()).squeeze(1).tolist()
    top_vals, top_ids = logp.topk(max(top_n), dim=-1)
    out = []
    for tok, lp, n, vals, ids in zip(tokens.tolist(), chosen, top_n, top_vals.tolist(), top_ids.tolist()):
        d = {t: v for t, v in zip(ids[:n], vals[:n])}
        d[tok] = lp
        out.append(d)
    return out


def record_token_logprobs(seqs: list, logits: torch.Tensor, tokens: torch.Tensor) -> None:
    """Appends to each sequence that asks (and has not failed) its sampled token's logprobs."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and s.error is None]
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    found = token_logprobs(logits[index], tokens[index], [seqs[i].params.logprobs for i in rows])
    for i, tok, d in zip(rows, tokens[index].tolist(), found):
        seqs[i].logprobs.append(d)
        seqs[i].cumulative_logprob += d[tok]


def record_prompt_logprobs(seq, hidden: torch.Tensor, first_pos: int, compute_logits) -> None:
    """A prefill chunk of `seq` whose rows `hidden` [n, D] hold positions first_pos.. : appends
    the logprobs of the prompt tokens those positions predict (position p predicts token p + 1;
    prompt token 0 gets None). Positions already recorded (a recomputed prompt) are skipped."""
    prompt = seq.prompt_token_ids
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)
    start = len(seq.prompt_logprobs) - 1  # the next position to record
    stop = min(first_pos + hidden.shape[0], len(prompt) - 1)
    for a in range(max(start, first_pos), stop, PROMPT_ROWS_AT_ONCE):
        b = min(a + PROMPT_ROWS_AT_ONCE, stop)
        logits = compute_logits(hidden[a - first_pos:b - first_pos])
        targets = torch.tensor(prompt[a + 1:b + 1], device=logits.device)
        seq.prompt_logprobs.extend(token_logprobs(logits, targets, [seq.params.prompt_logprobs] * (b - a)))
