"""A tool loop as an agent runs it, with the official `openai` client against `oasiskv serve`
of the evaluated model: the model calls a defined function (`tool_choice` "required" and
named; one call: `parallel_tool_calls` false), the client answers with a `role: tool` message,
and the model answers in text (`tool_choice` "auto"); streamed and not. Each call's id and JSON
arguments are checked."""
from __future__ import annotations

import json

from oasiskv.distributed.group import free_port

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 32}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now, in celsius?"}]
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}


def _server_args(args) -> list[str]:
    out = ["--max-model-len", "4096", "--log-level", "warning", "--disable-log-stats"]
    if args.model:
        out += ["--model", args.model]
    if args.sparse:
        out += ["--sparse"] + (["--sparse-threshold", str(args.sparse_threshold)] if args.sparse_threshold else [])
    return out


def _ask(client, stream: bool, **kw) -> tuple[str, list[dict]]:
    """(content, tool calls as {id, name, arguments}); a stream accumulated chunk by chunk."""
    if not stream:
        m = client.chat.completions.create(**kw).choices[0].message
        return m.content or "", [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                                 for c in m.tool_calls or []]
    content, calls = "", {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            acc = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            acc["id"] += tc.id or ""
            if tc.function is not None:
                acc["name"] += tc.function.name or ""
                acc["arguments"] += tc.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


def _valid(call: dict) -> bool:
    import jsonschema

    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
    try:
        jsonschema.validate(json.loads(call["arguments"]), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_tool_loop(args) -> list[dict]:
    from openai import OpenAI

    from oasiskv.entrypoints.openai.server_process import start_server, stop_server

    port = free_port()
    proc = start_server(_server_args(args), "127.0.0.1", port)
    rows = []
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        for choice_name, choice in CHOICES.items():
            for stream in (False, True):
                kw = dict(model=client.models.list().data[0].id, temperature=0, max_tokens=120, tools=TOOLS,
                          parallel_tool_calls=False)
                _, calls = _ask(client, stream, messages=QUESTION, tool_choice=choice, **kw)
                row = {"tool_choice": choice_name, "stream": stream, "called": [c["name"] for c in calls],
                       "arguments": [c["arguments"] for c in calls],
                       "id_ok": bool(calls) and all(c["id"].startswith("call_") for c in calls),
                       "arguments_valid": bool(calls) and all(_valid(c) for c in calls),
                       "answer": None, "answered_in_text": False}
                if calls:
                    history = QUESTION + [
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": c["id"], "type": "function",
                             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]}]
                    history += [{"role": "tool", "tool_call_id": c["id"],
                                 "content": json.dumps({"city": "Paris", "temperature": 18, "unit": "celsius",
                                                        "sky": "cloudy"})} for c in calls]
                    text, again = _ask(client, stream, messages=history, tool_choice="auto", **kw)
                    row["answer"], row["answered_in_text"] = text, bool(text.strip()) and not again
                rows.append(row)
    finally:
        stop_server(proc)
    return rows
