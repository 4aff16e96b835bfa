"""Grammar-constrained decoding (JSON object, JSON schema, regex, choice) through llguidance.

`Grammars` is the engine's: the tokenizer as llguidance sees it (built on first use, in a
fraction of a second to seconds: docs/serving.md) and the compile of a request's `StructuredOutput`.
`RequestGrammar` is a request's matcher: before each sampled token it gives the bitmask of the
tokens its grammar allows; only a generated token advances it (`accept`), a lookahead draft
never does (`draft_mask` consumes the draft, reads the mask and rolls back).

The mask is applied on the logits' device (`apply_bitmask`) after the request's other rules and
before temperature, outside any CUDA graph. The library is imported on first use, so an install
without it serves everything else and answers a structured request with a ValueError (a 400).
"""
from __future__ import annotations

import importlib.util
import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from oasiskv.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from llguidance import LLMatcher
    from transformers import PreTrainedTokenizerBase

INSTALL_HINT = "structured output needs the `llguidance` package: pip install llguidance"
NAMES = {"json_object": "JSON object", "json_schema": "JSON schema", "regex": "regex", "choice": "choice",
         "lark": "grammar"}
CACHED_GRAMMARS = 64  # compiled grammars kept (the server's check and the engine's matcher share one)


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return llguidance


def backend() -> str | None:
    """The grammar library this install has ("llguidance"), or None."""
    return "llguidance" if importlib.util.find_spec("llguidance") is not None else None


def grammar_text(so: StructuredOutput) -> str:
    """llguidance's grammar for `so`. JSON is compact (no free whitespace: a small model could
    otherwise spend its tokens on blanks); a non-strict schema ignores keywords the grammar
    cannot enforce, a strict one refuses them."""
    ll = _llguidance()
    options = {"whitespace_flexible": False, "lenient": not so.strict}
    if so.kind == "json_object":
        return ll.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if so.kind == "json_schema":
        try:
            return ll.LLMatcher.grammar_from_json_schema(so.spec, defaults=options)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
    if so.kind == "regex":
        return ll.LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "lark":
        return ll.LLMatcher.grammar_from_lark(so.spec)
    # choice: the strings as Lark literals (JSON string syntax), one of them exactly
    return ll.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.spec))


def _key(so: StructuredOutput) -> str:
    return json.dumps([so.kind, so.spec, so.strict], sort_keys=True)


class Grammars:
    """The engine's grammar compiler, safe to call from the server's threads and the engine's.
    A spec is compiled once: its pristine matcher is kept (least recently used out first) and each
    request gets a copy, so the server's check, the engine's matcher and a repeated schema share it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, stop_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self.compiles = 0  # grammars compiled so far (cache misses)

    def _tokenizer(self):
        ll = _llguidance()
        with self._lock:
            if self._ll_tokenizer is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer (this model has none)")
                self._ll_tokenizer = ll.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                          eos_token=self.stop_ids)
        return self._ll_tokenizer

    def matcher(self, so: StructuredOutput) -> RequestGrammar:
        """A fresh matcher for `so`; ValueError naming the fault if it does not compile."""
        ll = _llguidance()
        key = _key(so)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
        if compiled is None:  # compiled outside the lock: a large schema takes a while
            compiled = ll.LLMatcher(self._tokenizer(), grammar_text(so))
            if compiled.is_error():
                raise ValueError(f"invalid {NAMES[so.kind]}: {compiled.get_error()}")
            with self._lock:
                self.compiles += 1
                self._compiled[key] = compiled
                while len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        return RequestGrammar(compiled.deep_copy(), self.vocab_size)

    def check(self, so: StructuredOutput) -> None:
        """Raises ValueError if `so` does not compile (the server asks before submitting)."""
        self.matcher(so)


class RequestGrammar:
    """One request's grammar state: advanced by its generated tokens only."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.words = (vocab_size + 31) // 32

    def mask(self) -> torch.Tensor:
        """[words] int32 bitmask of the tokens allowed next (bit t % 32 of word t // 32)."""
        out = torch.empty(1, self.words, dtype=torch.int32)
        _llguidance().torch.fill_next_token_bitmask(self.matcher, out, 0)
        return out[0]

    def draft_mask(self, draft: int) -> torch.Tensor | None:
        """The mask after `draft` (a lookahead row's logits are for the position after its draft),
        the state left as it was; None if the grammar does not allow the draft (the row is only a
        prefetch hint: it stays unconstrained)."""
        m = self.matcher
        if m.is_stopped() or m.validate_tokens([draft]) != 1 or not m.consume_token(draft):
            return None
        try:
            return None if m.is_stopped() else self.mask()
        finally:
            m.rollback(1)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and takes no more tokens (a stop token was accepted, or none can follow)."""
        return self.matcher.is_stopped()


_executor = None  # llguidance's thread pool for the masks of a batch (`batch_masks`)


def batch_masks(grammars: list[RequestGrammar], pin: bool = False) -> torch.Tensor:
    """[n, words] the masks of n requests' grammars, filled in parallel on the library's own
    threads (the GIL released): a batch's masks cost about one mask, not n. pin: in pinned memory."""
    global _executor
    ll = _llguidance()
    if _executor is None:
        _executor = ll.LLExecutor()
    out = torch.empty(len(grammars), grammars[0].words, dtype=torch.int32, pin_memory=pin)
    ll.torch.fill_next_token_bitmask_par(_executor, [(g.matcher, i) for i, g in enumerate(grammars)], out)
    return out


def apply_bitmask(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """logits [B, V] set to -inf, in place, where the bitmasks [B, words] (on the host) have a 0 bit."""
    V = logits.shape[1]
    if logits.device.type == "cuda" and not masks.is_pinned():  # pinned: the copy queues behind the forward
        masks = masks.pin_memory()
    masks = masks.to(logits.device, non_blocking=True)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((masks[:, :, None] >> bits) & 1).flatten(1)[:, :V].bool()
    logits.masked_fill_(~allowed, float("-inf"))
