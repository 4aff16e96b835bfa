"""Structured output in the engine: every constrained output validates against its schema (or
matches its regex or choice), a finished grammar ends the request with "stop", a request without
a grammar decodes as it would alone, and an aborted request lets its matcher go."""
from __future__ import annotations

import gc
import json
import re
import sys
import weakref

import jsonschema
import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.engine.structured_output import INSTALL_HINT, apply_bitmask
from oasiskv.sampling_params import StructuredOutput

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": NAME, "address": {"type": "object", "properties": {"city": NAME, "zip": {
            "type": "integer", "minimum": 0, "maximum": 99999}}, "required": ["city", "zip"],
            "additionalProperties": False}}, "required": ["name", "address"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"role": {"enum": ["admin", "user", "guest"]},
                                              "active": {"type": "boolean"}},
             "required": ["role", "active"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
              "required": ["tags"], "additionalProperties": False},
}
QUESTION = "Give me a JSON record about a person."


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def chat(llm, text: str = QUESTION) -> str:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def constrained(kind: str, spec=None, **kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 0), max_tokens=kw.pop("max_tokens", 60),
                          structured=StructuredOutput(kind, spec), **kw)


def assert_valid(out, schema: dict) -> None:
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.slow
def test_outputs_validate_and_a_plain_request_is_unchanged(llm):
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate([chat(llm)], [plain])[0]
    names = list(SCHEMAS)
    params = [constrained("json_schema", SCHEMAS[n]) for n in names]
    params.append(constrained("json_object", temperature=0.8, seed=3))
    outs = llm.generate([chat(llm)] * (len(params) + 1), params + [plain])
    for name, out in zip(names, outs):
        assert_valid(out, SCHEMAS[name])
    assert isinstance(json.loads(outs[len(names)].text), dict)
    assert outs[-1].token_ids == alone.token_ids  # greedy, in a batch with grammared rows


def test_regex_and_choice_end_with_stop(llm):
    outs = llm.generate([chat(llm, "Give a code."), chat(llm, "Is the sky blue?")],
                        [constrained("regex", r"[0-9]{3}-[a-z]{2}"), constrained("choice", ["yes", "no", "maybe"])])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].text in ("yes", "no", "maybe") and outs[1].finish_reason == "stop"
    assert len(outs[1].token_ids) < 60  # ended by the grammar, not by max_tokens


def test_abort_mid_grammar_frees_the_matcher(llm):
    engine = llm.engine
    rid = engine.add_request(chat(llm), constrained("json_schema", SCHEMAS["nested"]))
    matcher = weakref.ref(engine.seqs[rid].grammar)
    for _ in range(3):
        engine.step()
    engine.abort(rid)
    gc.collect()
    assert matcher() is None and not engine.has_unfinished()
    again = llm.generate([chat(llm, "Is the sky blue?")], [constrained("choice", ["yes", "no"])])[0]
    assert again.text in ("yes", "no") and again.finish_reason == "stop"


def test_a_spec_is_compiled_once(llm):
    """The server's check and the engine's matcher (and a repeated spec) share one compile; each
    request still gets a matcher of its own."""
    grammars = llm.engine.grammars
    so = StructuredOutput("json_schema", {"type": "object", "properties": {"once": {"type": "integer"}}})
    before = grammars.compiles
    grammars.check(so)
    outs = llm.generate([chat(llm)] * 2, [SamplingParams(temperature=0, max_tokens=30, structured=so)] * 2)
    assert grammars.compiles == before + 1
    assert all(isinstance(json.loads(o.text), dict) for o in outs if o.finish_reason == "stop")
    assert grammars.matcher(so).matcher is not grammars.matcher(so).matcher


def test_bad_spec_and_missing_library_are_value_errors(llm, monkeypatch):
    with pytest.raises(ValueError, match="invalid JSON schema: Invalid type"):
        llm.engine.add_request("hi", constrained("json_schema", {"type": "nope"}))
    with pytest.raises(ValueError, match="^min_tokens"):
        constrained("json_object", min_tokens=2)
    with pytest.raises(ValueError, match="invalid regex"):
        llm.engine.add_request("hi", constrained("regex", "a(b"))
    monkeypatch.setitem(sys.modules, "llguidance", None)  # as if not installed
    with pytest.raises(ValueError, match=re.escape(INSTALL_HINT)):
        llm.engine.add_request("hi", constrained("json_object"))
    assert not llm.engine.has_unfinished()


@pytest.mark.slow
def test_preempted_request_keeps_its_grammar(llm):
    """A pool too small for the batch preempts and recomputes; the matcher, advanced only by
    generated tokens, goes on where it was: the same outputs as with room for all."""
    params = constrained("json_schema", SCHEMAS["nested"])
    prompts = [chat(llm), chat(llm, "A JSON record, please."), chat(llm, "Describe someone in JSON.")]
    want = llm.generate(prompts, params)
    # 3-page prompts growing to 4 pages each: 10 pages admit all three, not their growth (the
    # prefix cache off: the prompts' template would share pages).
    small = LLM(max_model_len=512, kv_cache_gb=10 * llm.engine.runner.kv_bytes_per_page / 2**30,
                enable_prefix_caching=False)
    got = small.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert sum(g.metrics["num_preemptions"] for g in got) > 0
    for out in got:
        assert_valid(out, SCHEMAS["nested"])


def test_async_scheduling_samples_a_grammared_step_after_the_one_before(llm):
    """Under async scheduling a grammared step's forward is launched before the step before is
    read, and sampled after it (its masks need the grammars advanced): the outputs are the
    synchronous loop's, and the steps overlapped."""
    params = [constrained("json_schema", SCHEMAS["enum"]), constrained("choice", ["yes", "no", "maybe"]),
              constrained("json_object", temperature=0.8, seed=3, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    prompts = [chat(llm), chat(llm, "Is the sky blue?"), chat(llm), chat(llm)]
    want = llm.generate(prompts, params)
    overlapped = LLM(max_model_len=512, async_scheduling="on")
    got = overlapped.generate(prompts, params)
    assert [(g.token_ids, g.finish_reason) for g in got] == [(w.token_ids, w.finish_reason) for w in want]
    assert overlapped.engine.step_stats["overlapped_steps"] > 0
    assert_valid(got[0], SCHEMAS["enum"])


@pytest.mark.parametrize("vocab", [64, 100, 49152])
def test_apply_bitmask_as_the_bits_say(vocab):
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    masks = torch.randint(-2**31, 2**31, (3, words), dtype=torch.int64, generator=gen).to(torch.int32)
    logits = torch.randn(3, vocab, generator=gen)
    got = logits.clone()
    apply_bitmask(got, masks)
    for b in range(3):  # the reference: bit t % 32 of word t // 32, one token at a time
        m = masks[b].tolist()
        want = [logits[b, t].item() if (m[t // 32] >> (t % 32)) & 1 else float("-inf") for t in range(vocab)]
        assert got[b].tolist() == want


def test_a_draft_never_advances_the_grammar(llm):
    grammar = llm.engine.grammars.matcher(StructuredOutput("choice", ["yes", "no"]))
    before = grammar.mask()
    allowed = [t for t in range(before.shape[0] * 32) if (before[t // 32] >> (t % 32)) & 1]
    after = grammar.draft_mask(allowed[0])
    assert after is not None and not torch.equal(after, before)
    assert torch.equal(grammar.mask(), before)  # as it was
    refused = next(t for t in range(1000) if t not in allowed)
    assert grammar.draft_mask(refused) is None and torch.equal(grammar.mask(), before)


@pytest.mark.slow
def test_sparse_outputs_validate():
    """Prompts past the threshold decode sparse (the batched pipeline); the
    draft rows are masked after their drafts but never advance the grammar."""
    llm = LLM(max_model_len=768, sparse=True, top_k_blocks=8, window_blocks=2, sink_blocks=1, sparse_threshold=256,
              fetch_ratio=0.25, host_kv_gb=0.25)
    filler = "Records are kept in a ledger, one line each, and checked every evening. " * 25
    prompt = chat(llm, filler + QUESTION)
    assert len(llm.tokenizer.encode(prompt)) > 300
    names = ["nested", "array", "nested"]
    params = [constrained("json_schema", SCHEMAS[n]) for n in names[:2]]
    params.append(constrained("json_schema", SCHEMAS["nested"], temperature=0.8, seed=1, max_tokens=80))
    outs = llm.generate([prompt] * 4, params + [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])
    for name, out in zip(names, outs):
        assert_valid(out, SCHEMAS[name])
        assert out.stats["sparse_steps"] > 0
