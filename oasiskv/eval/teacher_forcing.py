"""Teacher forcing through the real engine: a logits processor that keeps each step's
log-probabilities and makes the request emit the next token of a given text, so dense and
sparse decode are scored on the same token sequence (every step is a real decode step, sparse
where the engine decodes sparse)."""
from __future__ import annotations

import torch


class TeacherForcing:
    """Called by the sampler once per generated token, in order (SamplingParams.logits_processors)."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.logprobs: list[torch.Tensor] = []  # [V] float32 per step, on the CPU

    def __call__(self, row: torch.Tensor) -> torch.Tensor:
        step = len(self.logprobs)
        self.logprobs.append(torch.log_softmax(row.float(), -1).cpu())
        forced = torch.full_like(row, float("-inf"))
        forced[self.tokens[step]] = 0.0  # the only finite logit: greedy or sampled, this token
        return forced


def forced_params(tokens: list[int]):
    from oasiskv.sampling_params import SamplingParams
    return SamplingParams(temperature=0, max_tokens=len(tokens), ignore_eos=True,
                          logits_processors=[TeacherForcing(tokens)])


def forced_logprobs(llm, prompts: list[list[int]], continuations: list[list[int]],
                    extra: list | None = None) -> tuple[list[torch.Tensor], list]:
    """Log-probabilities [M, V] of each prompt's forced continuation (M = its length). `extra`:
    (prompt, SamplingParams) requests run in the same batch (their outputs are returned)."""
    params = [forced_params(c) for c in continuations]
    extra = extra or []
    outs = llm.generate(prompts + [p for p, _ in extra], params + [sp for _, sp in extra], use_tqdm=False)
    for o, c in zip(outs, continuations):
        assert o.token_ids == c, "teacher forcing did not hold"
    return [torch.stack(p.logits_processors[0].logprobs) for p in params], outs[len(prompts):]
