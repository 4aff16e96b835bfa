"""Logprobs of generated and prompt tokens against HF transformers' log-softmax on the real
default model (float32, CPU), with prompts chunked across prefill steps."""

import pytest
import torch

from oasiskv import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who"]
TOL = 1e-3


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_batched_tokens=8)  # every prompt here spans several prefill chunks


@pytest.fixture(scope="module")
def hf_model(hf_default):
    return hf_default[0]


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is HF's log-softmax for the token after ids[:i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)


def _check(entry: dict, ref_row: torch.Tensor, token: int, n: int):
    """entry holds `token` and the reference's top-n, each with the reference's logprob."""
    top = ref_row.topk(n).indices.tolist() if n else []
    assert set(entry) == set(top) | {token}
    for t, lp in entry.items():
        assert abs(lp - ref_row[t].item()) < TOL, (t, lp, ref_row[t].item())
def test_generated_and_prompt_logprobs_match_hf(llm, hf_model):
    ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert all(len(i) > 8 for i in ids[1:])  # chunks of 8: prompt logprobs cross chunk boundaries
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=3),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=20, prompt_logprobs=20)]
    steps = llm.engine.step_stats["prefill_steps"]
    outs = llm.generate(ids, params)
    assert llm.engine.step_stats["prefill_steps"] - steps >= sum(len(i) for i in ids) // 8
    for prompt, p, out in zip(ids, params, outs):
        ref = _hf_logprobs(hf_model, prompt + out.token_ids)
        assert out.token_ids == ref[len(prompt) - 1:-1].argmax(-1).tolist()
        assert len(out.logprobs) == len(out.token_ids)
        for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            _check(entry, ref[len(prompt) - 1 + i], tok, p.logprobs)
        assert abs(out.cumulative_logprob - sum(e[t] for t, e in zip(out.token_ids, out.logprobs))) < 1e-6
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for k in range(1, len(prompt)):
            _check(out.prompt_logprobs[k], ref[k - 1], prompt[k], p.prompt_logprobs)


def test_logprobs_are_raw_and_change_no_token(llm, hf_model):
    """Seeded sampling at temperature 0.7 with a penalty: the same tokens with or without
    logprobs, and the logprobs are the model's distribution, not the tempered, penalized one."""
    ids = llm.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    base = dict(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True, frequency_penalty=0.5)
    plain = llm.generate(ids, SamplingParams(**base))[0]
    out = llm.generate(ids, SamplingParams(**base, logprobs=2))[0]
    assert out.token_ids == plain.token_ids and plain.logprobs is None and plain.cumulative_logprob is None
    ref = _hf_logprobs(hf_model, ids + out.token_ids)
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        _check(entry, ref[len(ids) - 1 + i], tok, 2)


def test_one_token_prompt_has_only_the_empty_entry(llm):
    out = llm.generate([1], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    assert out.prompt_logprobs == [None]
