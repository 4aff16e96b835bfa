"""Output text on the asyncio side: token ids in, text pieces out, stop strings cut.

Decoding the whole output after every token costs O(n^2); like vLLM, only a short window is
decoded: the tokens since the last emitted piece plus the few before them (a token's text can
depend on its neighbour: leading spaces, multi-byte characters split across tokens). A piece
ending in U+FFFD (half a UTF-8 character) waits for the next token.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TextOptions:
    """How a choice's tokens become its text (vLLM's request fields of the same names)."""
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context for the next piece
        self.read_offset = 0  # tokens before it are emitted

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """The new text this token completes ("" while a character is still incomplete)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """At the end: whatever was held back, replacement characters included."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""


class StopStringText:
    """The text of one choice, cut before the first stop string (after it, with `include_stop`).
    `emittable()` is the part that can be sent now: while stop strings are set, the last
    (longest stop - 1) characters wait, since they may be the start of one."""

    def __init__(self, stop: list[str], include_stop: bool = False):
        self.stop, self.include_stop = stop, include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.stopped = False

    def append(self, piece: str) -> bool:
        """Add a piece; True once a stop string appeared (the text is then cut before it)."""
        if not piece or self.stopped:
            return self.stopped
        start = max(0, len(self.text) - self.hold)  # a match may begin in the held tail
        self.text += piece
        hits = [(i, -len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if hits:
            at, minus_len = min(hits)  # the earliest match; of those starting there, the longest
            self.text = self.text[:at - minus_len if self.include_stop else at]
            self.stopped = True
        return self.stopped

    def emittable(self, final: bool) -> int:
        return len(self.text) if final or self.stopped else max(0, len(self.text) - self.hold)
