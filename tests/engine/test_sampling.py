"""Sampling: seeds, top-k/top-p, stops, lengths — on the real default model."""
import json

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.engine.sampler import sample
from oasiskv.entrypoints.cli import main as cli_main

PROMPT = "Write a short poem about the sea:"


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    p = lambda seed: SamplingParams(temperature=1.0, max_tokens=24, seed=seed, ignore_eos=True)
    a, b, c = llm.generate([PROMPT, PROMPT, PROMPT], [p(1), p(1), p(2)])
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    again = llm.generate(PROMPT, p(1))[0]
    assert again.token_ids == a.token_ids


@pytest.mark.slow
def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    topk1 = llm.generate(PROMPT, SamplingParams(temperature=0.8, top_k=1, max_tokens=16, seed=3,
                                                ignore_eos=True))[0]
    assert topk1.token_ids == greedy.token_ids


def test_top_p_and_top_k_restrict_the_support():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    probs = torch.softmax(logits, -1)
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.3), SamplingParams(top_p=0.3, top_k=2),
              SamplingParams(temperature=0)]
    for _ in range(200):
        tok = sample(logits, params, [None] * 4)
        assert tok[0] in logits[0].topk(3).indices
        order = probs[1].argsort(descending=True)
        mass_before = probs[1][order].cumsum(0) - probs[1][order]
        assert tok[1] in order[mass_before < 0.3]
        assert tok[2] in logits[2].topk(2).indices
        assert tok[3] == logits[3].argmax()


def test_min_p_keeps_tokens_near_the_likeliest():
    """min_p = 0.5 keeps the tokens with at least half the top token's probability (after the
    temperature), and samples among all of them; min_p = 1 is greedy."""
    logits = torch.tensor([[2.0, 2.0 - 0.5, 2.0 - 0.6, 2.0 - 0.8, -3.0, -5.0]])
    seen = set()
    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        seen.add(int(sample(logits, [SamplingParams(min_p=0.5)], [g])[0]))
    assert seen == {0, 1, 2}  # exp(-0.8) = 0.45 < 0.5 <= exp(-0.6)
    half_temp = {int(sample(logits, [SamplingParams(min_p=0.5, temperature=0.5)], [None])[0]) for _ in range(200)}
    assert half_temp == {0}  # at temperature 0.5 the second is exp(-0.5 / 0.5) = 0.37 of the first
    assert {int(sample(logits, [SamplingParams(min_p=1.0)], [None])[0]) for _ in range(50)} == {0}
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


@pytest.mark.slow
def test_max_tokens_and_stop_token(llm):
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert len(free.token_ids) == 12 and free.finish_reason == "length"
    stop_at = free.token_ids[5]
    stopped = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"


@pytest.mark.slow
def test_stop_string_cuts_the_text(llm):
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    word = free.text.split()[3]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=[word], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert word not in out.text and free.text.startswith(out.text)


@pytest.mark.slow
def test_eos_ends_unless_ignored(llm):
    chat = llm.apply_chat_template([{"role": "user", "content": "Say just the word yes."}])
    out = llm.generate(chat, SamplingParams(temperature=0, max_tokens=64))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    longer = llm.generate(chat, SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 3,
                                               ignore_eos=True))[0]
    assert len(longer.token_ids) == len(out.token_ids) + 3


@pytest.mark.slow
def test_cli_generate_json(capsys):
    assert cli_main(["generate", "--prompt", "The capital of France is", "--max-tokens", "5", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert isinstance(d["text"], str) and len(d["token_ids"]) == 5
    assert all(isinstance(t, int) for t in d["token_ids"])
