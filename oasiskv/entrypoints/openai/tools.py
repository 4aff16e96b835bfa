"""Chat `tools` and `tool_choice`, as far as they go today: the tools' definitions are rendered
into the prompt by the model's chat template, and `tool_choice` must be "none" (the model may
read about the tools but its answer is text: tool calls are not parsed out of it yet). Anything
else is a 400 that says so, rather than tool calls returned as plain text."""
from __future__ import annotations

from oasiskv.entrypoints.openai.protocol import APIError, ChatCompletionRequest

FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"`{param}` {message}", param=param, code=code)


def chat_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools to render through the chat template, or None."""
    choice = req.tool_choice
    if choice is not None and choice != "none":
        raise _bad("tool_choice", 'supports only "none" for now (tool calls are not parsed yet)',
                   "unsupported_parameter")
    tools = req.tools
    if tools is None:
        return None
    if choice is None:
        raise _bad("tools", 'needs `tool_choice`: "none" for now (tool calls are not parsed yet)',
                   "unsupported_parameter")
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
            raise _bad("tools", f'[{i}] must be {{"type": "function", "function": {{...}}}}')
        if not isinstance(fn.get("name"), str) or not fn["name"] or set(fn) - FUNCTION_FIELDS:
            raise _bad("tools", f"[{i}].function takes a non-empty `name` and only {sorted(FUNCTION_FIELDS)}")
        if not isinstance(fn.get("parameters", {}), dict) or not isinstance(fn.get("description", ""), str):
            raise _bad("tools", f"[{i}].function's `parameters` must be an object and `description` a string")
    return tools
