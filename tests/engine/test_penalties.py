"""Penalties, logit bias and min_tokens: the sampler's rule against a hand-written reference,
and each one changing what the engine samples as defined (dense, async and sparse paths)."""
import pytest
import torch
from logit_recorder import record_logits

from oasiskv import LLM, SamplingParams
from oasiskv.engine.penalties import apply_rules
from oasiskv.engine.sampler import sample_requests
from oasiskv.engine.sequence import Sequence

V = 40


def _seq(prompt, output, **params):
    seq = Sequence("r", prompt, SamplingParams(**params))
    seq.output_token_ids = list(output)
    return seq


def _reference(row, prompt, output, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """The rules written out token by token (vLLM's definitions)."""
    row = row.clone()
    for t, b in (bias or {}).items():
        row[t] += b
    for t in range(len(row)):
        if repetition != 1 and (t in prompt or t in output):
            row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
        count = output.count(t)
        row[t] -= frequency * count + presence * (count > 0)
    return row


@pytest.mark.parametrize("kw", [dict(frequency_penalty=0.7), dict(presence_penalty=-1.3),
                                dict(repetition_penalty=1.8), dict(repetition_penalty=0.5),
                                dict(frequency_penalty=2, presence_penalty=0.4, repetition_penalty=1.3,
                                     logit_bias={3: 5.0, 7: -100})])
def test_rules_match_the_reference(kw):
    torch.manual_seed(0)
    row = torch.randn(V) * 3
    prompt, output = [1, 2, 3, 9], [5, 5, 5, 7, 2, 30]
    seq = _seq(prompt, output, **kw)
    got = apply_rules(row, seq)
    ref = _reference(row, prompt, output, kw.get("presence_penalty", 0), kw.get("frequency_penalty", 0),
                     kw.get("repetition_penalty", 1), kw.get("logit_bias"))
    assert torch.allclose(got, ref, atol=1e-6)
    # Counts kept on the sequence are brought up to date as tokens arrive.
    seq.output_token_ids += [5, 11]
    ref = _reference(row, prompt, output + [5, 11], kw.get("presence_penalty", 0), kw.get("frequency_penalty", 0),
                     kw.get("repetition_penalty", 1), kw.get("logit_bias"))
    assert torch.allclose(apply_rules(row, seq), ref, atol=1e-6)


def test_frequency_penalty_changes_the_greedy_token():
    row = torch.zeros(V)
    row[4], row[6] = 2.0, 1.5
    seq = _seq([0], [4, 4], temperature=0, frequency_penalty=0.3)  # 2 - 0.6 = 1.4 < 1.5
    assert sample_requests(row[None], [seq]).item() == 6
    seq = _seq([0], [4, 4], temperature=0, frequency_penalty=0.2)  # 2 - 0.4 = 1.6 > 1.5
    assert sample_requests(row[None], [seq]).item() == 4


def test_draft_row_sees_its_draft_as_generated():
    """A lookahead draft row's logits are for the position after its draft: its rules count it."""
    torch.manual_seed(1)
    row = torch.randn(V)
    seq = _seq([1], [5, 6], frequency_penalty=1.0, min_tokens=4, stop_token_ids=[8])
    seq.min_tokens_stop_ids = [8]
    ahead = _seq([1], [5, 6, 9], frequency_penalty=1.0, min_tokens=4, stop_token_ids=[8])
    ahead.min_tokens_stop_ids = [8]
    assert torch.equal(apply_rules(row, seq, torch.tensor(9)), apply_rules(row, ahead))
    assert apply_rules(row, seq)[8] == float("-inf") and apply_rules(row, ahead)[8] == float("-inf")
    done = _seq([1], [5, 6, 9, 9], min_tokens=4)
    done.min_tokens_stop_ids = [8]
    assert apply_rules(row, done)[8] == row[8]


@pytest.mark.parametrize("kw, words", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={1: 101}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"), (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(logprobs=True), "logprobs"), (dict(temperature=1e-45), "temperature"),
    (dict(seed=2**64), "seed"), (dict(top_k=2.5), "top_k")])
def test_bad_values_name_their_field(kw, words):
    with pytest.raises(ValueError, match=f"^{words}"):
        SamplingParams(**kw)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def test_engine_checks_ids_against_the_vocabulary(llm):
    vocab = llm.engine.runner.model_config.vocab_size
    with pytest.raises(ValueError, match="^top_k"):
        llm.engine.add_request("hi", SamplingParams(top_k=10**20))
    with pytest.raises(ValueError, match="^logit_bias"):
        llm.engine.add_request("hi", SamplingParams(logit_bias={vocab: 1.0}))


def test_huge_logit_bias_forces_its_token(llm):
    tok = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                                 logit_bias={tok: 100}))[0]
    assert out.token_ids == [tok] * 5


@pytest.mark.slow
def test_engine_applies_penalties_as_defined(llm):
    """Every greedy token is the argmax of that step's raw logits after the reference's rules."""
    ids = llm.tokenizer.encode("1, 2, 1, 2, 1, 2, 1, 2,", add_special_tokens=False)
    kw = dict(presence_penalty=0.5, frequency_penalty=0.8, repetition_penalty=1.3)
    plain = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    seen, restore = record_logits(llm)
    try:
        out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw))[0]
    finally:
        restore()
    assert out.token_ids != plain.token_ids  # the penalties matter here
    for i, (logits, tok) in enumerate(zip(seen, out.token_ids)):
        ref = _reference(logits[0], ids, out.token_ids[:i], kw["presence_penalty"], kw["frequency_penalty"],
                         kw["repetition_penalty"])
        assert tok == ref.argmax().item()


@pytest.mark.slow
def test_min_tokens_holds_eos_back(llm):
    chat = llm.apply_chat_template([{"role": "user", "content": "Say just the word yes."}])
    free = llm.generate(chat, SamplingParams(temperature=0, max_tokens=64))[0]
    n = len(free.token_ids)
    assert free.finish_reason == "stop" and free.token_ids[-1] in llm.engine.eos_token_ids
    out = llm.generate(chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 3))[0]
    assert len(out.token_ids) >= n + 3
    assert out.token_ids[:n - 1] == free.token_ids[:-1]  # the same until the EOS it may not emit
    assert not set(out.token_ids[:n + 3]) & llm.engine.eos_token_ids
    # A stop token id is held back the same way.
    stop = free.token_ids[1]
    held = llm.generate(chat, SamplingParams(temperature=0, max_tokens=8, min_tokens=4, stop_token_ids=[stop]))[0]
    assert stop not in held.token_ids[:4] and len(held.token_ids) >= 4


@pytest.mark.slow
def test_async_scheduling_gives_the_same_tokens(llm):
    """Penalties and logprobs take the synchronous path, bias and min_tokens overlap: every
    request samples what it samples with async scheduling off."""
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=1.0, logprobs=1),
              SamplingParams(temperature=0.8, seed=2, max_tokens=10, min_tokens=4, logit_bias={11: 3.0}),
              SamplingParams(temperature=0, max_tokens=10, min_tokens=6, repetition_penalty=1.5)]
    prompts = ["1, 2, 1, 2, 1,", "The capital of France is", "Say yes."]
    engine, runs = llm.engine, {}
    try:
        for mode in (False, True):
            engine.async_scheduling = mode
            before = engine.step_stats["overlapped_steps"]
            runs[mode] = llm.generate(prompts, params)
            assert engine.step_stats["overlapped_steps"] == before  # penalties keep the batch synchronous
        only = llm.generate(prompts[1:2], params[1:2])
        assert engine.step_stats["overlapped_steps"] > before  # bias and min_tokens overlap
    finally:
        engine.async_scheduling = False
    assert only[0].token_ids == runs[False][1].token_ids
    for a, b in zip(runs[False], runs[True]):
        assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)
