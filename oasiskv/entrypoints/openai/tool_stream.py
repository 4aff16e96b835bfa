"""A streamed choice's text split into `delta.content` and `delta.tool_calls`, when the request
parses tool calls: text that cannot be a call is sent as it comes; from where the parser says a
call may begin, it is held, and at the end it goes out as one `tool_calls` chunk per call (id,
name and the whole arguments) or, if it does not parse as calls, as content."""
from __future__ import annotations

from oasiskv.entrypoints.openai.tool_parsers import ToolCall


class ToolCallStream:
    def __init__(self, parser, forced: bool, parallel: bool):
        self.parser, self.forced, self.parallel = parser, forced, parallel
        self.text, self.sent = "", 0

    def content(self, piece: str) -> str:
        """The part of the text so far that can go out as content now."""
        self.text += piece
        end = self.sent if self.forced else max(self.sent, self.parser.held_from(self.text))
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the held text that is content after all, the calls) at the choice's end."""
        _, calls = self.parser.parse(self.text)
        if not calls:
            return self.text[self.sent:], []
        return "", calls if self.parallel else calls[:1]
