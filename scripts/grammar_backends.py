"""Times the two grammar libraries OasisKV could constrain decoding with (xgrammar, llguidance)
on this CPU, with a model's own tokenizer: the tokenizer set-up (once per engine), the compile of
a nested JSON schema (once per schema), and per generated token the mask fill plus the state
advance, over the tokens of a valid instance; and each library's mask application beside the
engine's own (`apply_bitmask`). The numbers are in docs/serving.md.

Usage: .venv/bin/python scripts/grammar_backends.py [model ...]   (default: the embedded
SmolLM2-135M and the downloaded qwen2.5-coder-0.5b); a library that is not installed is skipped
(`.venv/bin/pip install xgrammar` to time it too: it is no dependency of OasisKV).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from oasiskv.engine.structured_output import apply_bitmask
from oasiskv.models.loader import resolve_model
from oasiskv.models.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"], "additionalProperties": False}},
            "required": ["street", "city", "geo"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "scores": {"type": "array", "items": {"type": "object", "properties": {
            "subject": {"type": "string"}, "value": {"type": "number"}}, "required": ["subject", "value"]}},
    },
    "required": ["name", "age", "role", "address", "tags", "scores"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "role": "admin",
            "address": {"street": "12 St James's Square", "city": "London", "geo": {"lat": 51.507, "lon": -0.135}},
            "tags": ["math", "engines", "poetry"],
            "scores": [{"subject": "analysis", "value": 9.5}, {"subject": "notes", "value": 10}]}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us"


def per_token(fill, accept, tokens: list[int]) -> tuple[float, float]:
    """Median and mean seconds of one mask fill + one state advance (the mean holds work a
    library defers to the first tokens)."""
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        fill()
        accept(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), statistics.mean(times)


def apply_time(apply, mask: torch.Tensor, vocab: int) -> float:
    """Median seconds of applying a mask to a [1, vocab] float32 row, after a first call."""
    logits = torch.randn(1, vocab)
    apply(logits, mask)
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        apply(logits, mask)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_xgrammar(tok, vocab: int, eos: list[int], tokens: list[int]) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, strict_mode=True,
                                           separators=(",", ":"))
    compile_s = time.perf_counter() - t0
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)

    def accept(t):
        assert m.accept_token(t), t
    step = per_token(lambda: m.fill_next_token_bitmask(mask), accept, tokens)
    return {"setup": setup, "compile": compile_s, "step": step, "apply": apply_time(xgr.apply_token_bitmask_inplace, mask, vocab)}


def bench_llguidance(tok, vocab: int, eos: list[int], tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    t0 = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos[0])
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(lt, grammar)
    assert not m.is_error(), m.get_error()
    compile_s = time.perf_counter() - t0
    mask = llt.allocate_token_bitmask(1, vocab)

    def accept(t):
        assert m.consume_token(t), (t, m.get_error())
    step = per_token(lambda: llt.fill_next_token_bitmask(m, mask, 0), accept, tokens)
    return {"setup": setup, "compile": compile_s, "step": step, "apply": apply_time(llt.apply_token_bitmask_inplace, mask, vocab)}


def main(models: list[str | None]) -> None:
    torch.set_num_threads(1)
    for model in models:
        source = resolve_model(model)
        tok = load_tokenizer(source)
        vocab = source.config.vocab_size
        eos = [t for t in (tok.eos_token_id,) if t is not None] or list(source.config.eos_token_ids)
        tokens = tok.encode(json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False) + eos[:1]
        print(f"{source.config.name}: vocabulary {vocab}, {len(tokens)} tokens in the instance")
        ones = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        print(f"  the engine's own apply_bitmask on a [1, {vocab}] row: {us(apply_time(apply_bitmask, ones, vocab))}")
        for name, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
            try:
                r = bench(tok, vocab, eos, tokens)
            except ImportError as e:
                print(f"  {name}: not installed ({e})")
                continue
            print(f"  {name:10s} tokenizer set-up {ms(r['setup'])}, schema compile {ms(r['compile'])}, "
                  f"mask + advance per token {us(r['step'][0])} (mean {us(r['step'][1])}), mask applied to the logits {us(r['apply'])}")


if __name__ == "__main__":
    main(sys.argv[1:] or [None, "qwen2.5-coder-0.5b"])
