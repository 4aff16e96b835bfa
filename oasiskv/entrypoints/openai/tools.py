"""Chat `tools`, `tool_choice` and `parallel_tool_calls`, read into one `ToolUse`.

The tools' definitions are rendered into the prompt by the model's chat template; the reply is
parsed for calls by the model's tool parser (tool_parsers.py). `tool_choice`: "none" (text only,
nothing parsed), "auto" (the default with tools: parse whatever the model writes), "required"
(a grammar forces one or more calls of the given tools) or {"type": "function", "function":
{"name"}} (a grammar forces calls of that function). `parallel_tool_calls` false allows one call.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from oasiskv.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from oasiskv.sampling_params import StructuredOutput

FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"`{param}` {message}", param=param, code=code)


@dataclass
class ToolUse:
    tools: list[dict]  # as rendered by the chat template
    choice: str  # "none" | "auto" | "required" | "named"
    functions: list[dict]  # the functions a call may name (one for "named")
    parallel: bool

    @property
    def parse(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def grammar(self, parser, tokenizer) -> StructuredOutput:
        """The grammar that forces calls in the parser's wrapper ("required" and "named" only)."""
        return StructuredOutput("lark", parser.grammar(self.functions, self.parallel, tokenizer))


def _functions(tools) -> list[dict]:
    if not isinstance(tools, list) or not tools:
        raise _bad("tools", "must be a non-empty list of tools")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            got = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise _bad("tools", f'[{i}] has type {got!r}: only {{"type": "function", "function": {{...}}}} '
                                "tools are supported", "unsupported_parameter")
        fn = tool.get("function")
        if not isinstance(fn, dict) or set(tool) != {"type", "function"}:
            raise _bad("tools", f'[{i}] must be {{"type": "function", "function": {{...}}}}')
        if not isinstance(fn.get("name"), str) or not FUNCTION_NAME.match(fn["name"]) or set(fn) - FUNCTION_FIELDS:
            raise _bad("tools", f"[{i}].function takes a `name` of 1 to 64 letters, digits, _ or - and only "
                                f"{sorted(FUNCTION_FIELDS)}")
        if not isinstance(fn.get("parameters", {}), dict) or not isinstance(fn.get("description", ""), str):
            raise _bad("tools", f"[{i}].function's `parameters` must be an object and `description` a string")
        if not isinstance(fn.get("strict", False), bool):
            raise _bad("tools", f"[{i}].function's `strict` must be a boolean")
        functions.append(fn)
    if len({fn["name"] for fn in functions}) < len(functions):
        raise _bad("tools", "names a function twice")
    return functions


def chat_tools(req: ChatCompletionRequest) -> ToolUse | None:
    """The request's tool use, or None (no tools); a malformed or unsupported form is a 400."""
    choice, tools = req.tool_choice, req.tools
    if tools is None:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "needs `tools`")
        return None
    functions = _functions(tools)
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", f'must be "none", "auto", "required" or {{"type": "function", "function": '
                                      f'{{"name": ...}}}}, got {choice!r}')
    elif (isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "function"}
          and isinstance(choice["function"], dict) and set(choice["function"]) == {"name"}):
        name = choice["function"]["name"]
        named = [fn for fn in functions if fn["name"] == name]
        if not named:
            raise _bad("tool_choice", f"names the function {name!r}, which is not in `tools` "
                                      f"({', '.join(fn['name'] for fn in functions)})")
        functions, choice = named, "named"
    else:
        raise _bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": '
                                  '{"name": ...}}', "unsupported_parameter")
    use = ToolUse(tools, choice, functions, parallel=req.parallel_tool_calls is not False)
    if use.forced and any(getattr(req, f) is not None for f in ("response_format", "guided_json", "guided_regex",
                                                               "guided_choice")):
        raise _bad("tool_choice", f"{choice!r} constrains the reply itself: it does not go with `response_format` "
                                  "or guided_*", "unsupported_parameter")
    return use
