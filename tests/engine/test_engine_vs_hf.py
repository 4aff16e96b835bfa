"""The engine against HF transformers on the real default model (float32, CPU)."""

import pytest
import torch
from logit_recorder import record_logits

from oasiskv import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "import numpy as np\nx = np.arange(10)\n",
    "Water boils at a temperature of",
    "The quick brown fox",
    "In 1969, the first humans",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def hf_model(hf_default):
    return hf_default[0]


def test_logits_and_tokens_match_hf(llm, hf_model):
    """Prefill + 32 decode steps: every step's logits agree with HF's forward over the same
    tokens, and each greedy token is HF's argmax."""
    ids = llm.tokenizer.encode("The history of the Roman Empire spans many centuries. It began",
                               add_special_tokens=False)
    seen, restore = record_logits(llm)
    try:
        out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=33, ignore_eos=True))[0]
    finally:
        restore()
    assert len(seen) == 33  # one prefill step + 32 decode steps
    full = ids + out.token_ids
    with torch.no_grad():
        ref = hf_model(torch.tensor([full])).logits[0, len(ids) - 1:-1]
    ours = torch.cat(seen)
    assert out.token_ids == ref.argmax(-1).tolist()
    rel = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 1e-4, f"relative logit error {rel:.2e}"


def test_greedy_tokens_match_hf_generate(llm, hf_model):
    ids = llm.tokenizer.encode(PROMPTS[2], add_special_tokens=False)
    out = llm.generate(ids, GREEDY)[0]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=2)
    assert out.token_ids == ref[0, len(ids):].tolist()


def test_batch_equals_alone(llm):
    """16 tokens: past a block boundary for every prompt (each alone is 16 steps at batch 1)."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = llm.generate(PROMPTS, greedy)
    for prompt, b in zip(PROMPTS, batched):
        alone = llm.generate(prompt, greedy)[0]
        assert b.token_ids == alone.token_ids, prompt


def test_chunked_prefill_equals_one_shot(llm):
    prompt = " ".join(PROMPTS) * 6  # a few hundred tokens
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one_shot = llm.generate(prompt, params)[0]
    chunked = LLM(max_num_batched_tokens=37).generate(prompt, params)[0]
    assert chunked.token_ids == one_shot.token_ids


def test_preemption_recomputes_the_same_tokens(llm):
    """A KV pool too small for every sequence at once forces preemption; output is unchanged."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = llm.generate(PROMPTS, params)
    # ~14-token prompts + 40 outputs = 4 pages each; 12 pages cannot hold 8 sequences.
    small = LLM(kv_cache_gb=12 * llm.engine.runner.kv_bytes_per_page / 2**30)
    assert small.engine.block_manager.num_pages == 12
    got = small.generate(PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert sum(g.metrics["num_preemptions"] for g in got) > 0
