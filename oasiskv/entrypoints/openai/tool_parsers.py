"""Tool-call parsers: one per way a model family writes its calls, each able to (1) turn the
generated text into OpenAI `tool_calls` and (2) write the llguidance grammar that forces its own
wrapper around a defined function's arguments (`tool_choice` "required" or a named function).

- `hermes` (Qwen2.5, Qwen3, ChatML templates such as SmolLM2's): `<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>`, one block per call.
- `llama3_json` (Llama 3.x): `{"name": ..., "parameters": {...}}`, calls separated by "; ",
  optionally after `<|python_tag|>`; a reply that is not all calls is text.

The parser of a model is chosen from its chat template (`pick_parser`).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj, args_key: str) -> ToolCall | None:
    """A ToolCall from a decoded {"name", args_key: {...}}, None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _arguments_grammar(fn: dict) -> str:
    """The function's `parameters` as an embedded compact JSON grammar (strict if the function is)."""
    schema = dict(fn.get("parameters") or {"type": "object"})
    schema["x-guidance"] = {"whitespace_flexible": False, "lenient": not fn.get("strict", False)}
    return "%json " + json.dumps(schema)


def _literal(text: str, tokenizer) -> str:
    """A Lark literal for `text`; a marker the tokenizer holds as one added token (Qwen's
    `<tool_call>`) is that token (llguidance matches an added token only by id)."""
    if tokenizer is not None and text in getattr(tokenizer, "get_added_vocab", dict)():
        return f"<[{tokenizer.convert_tokens_to_ids(text)}]>"
    return json.dumps(text)


def _calls_grammar(functions: list[dict], parallel: bool, separator: str, lead: str, args_key: str,
                   tail: str, opening: str = "") -> str:
    """Lark rules for one call (or, parallel, several joined by `separator`) of the given functions,
    each written `opening` `lead{"name": NAME, "ARGS_KEY": ` its arguments `tail`."""
    rules = ["start: call" + (f" ({json.dumps(separator)} call)*" if parallel else ""),
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, fn in enumerate(functions):
        head = json.dumps(lead + '{"name": ' + json.dumps(fn["name"]) + f', "{args_key}": ')
        parts = [opening, head, f"args_{i}", tail]
        rules += [f"call_{i}: " + " ".join(p for p in parts if p), f"args_{i}: {_arguments_grammar(fn)}"]
    return "\n".join(rules)


class HermesParser:
    name = "hermes"
    start = "<tool_call>"  # the text from which a reply is (or holds) tool calls
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text before the first call or None, the calls). A block that does not parse leaves it
        all text, unless it is an unterminated last one after complete calls (cut by max_tokens)."""
        head, sep, _ = text.partition(self.start)
        if not sep:
            return text, []
        calls = []
        blocks = self._block.findall(text)
        for i, body in enumerate(blocks):
            try:
                call = _call(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None and i == len(blocks) - 1 and i > 0 and not text.rstrip().endswith("</tool_call>"):
                break  # a last call cut short by max_tokens: the complete ones before it stand
            if call is None:
                return text, []
            calls.append(call)
        return head.strip() or None, calls

    def held_from(self, text: str) -> int:
        """Where a call may begin in streamed `text`: what comes before it can be sent as content."""
        at = text.find(self.start)
        if at >= 0:
            return at
        partial = next((k for k in range(len(self.start) - 1, 0, -1) if text.endswith(self.start[:k])), 0)
        return len(text) - partial

    def grammar(self, functions: list[dict], parallel: bool, tokenizer) -> str:
        open_, close = _literal("<tool_call>", tokenizer), _literal("</tool_call>", tokenizer)
        return _calls_grammar(functions, parallel, "\n", "\n", "arguments", f'"}}\\n" {close}', open_)


class Llama3JsonParser:
    name = "llama3_json"
    start = "{"  # only at the reply's start (after blanks and <|python_tag|>)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").lstrip()
        if not body.startswith("{"):
            return text, []
        calls, decoder, pos = [], json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            pos = len(body) - len(body[pos:].lstrip().removeprefix(";").lstrip())
        return None, calls

    def held_from(self, text: str) -> int:
        """A reply that is blank so far or opens with a JSON object may be calls: held whole."""
        body = text.lstrip()
        return 0 if not body or body.startswith(("{", "<|python_tag|>")) else len(text)

    def grammar(self, functions: list[dict], parallel: bool, tokenizer) -> str:
        return _calls_grammar(functions, parallel, "; ", "", "parameters", '"}"')


PARSERS = {p.name: p for p in (HermesParser(), Llama3JsonParser())}


def pick_parser(chat_template: str | None) -> HermesParser | Llama3JsonParser:
    """Llama 3's header tokens mean its JSON calls; any other template (ChatML: Qwen, SmolLM2) Hermes'."""
    if chat_template and "<|start_header_id|>" in chat_template:
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]
