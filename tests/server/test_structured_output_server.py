"""Structured output through the server: response_format with the official openai client (chat,
streamed too) and vLLM's guided_* on /v1/completions; each output validates. And tools: calls
forced by tool_choice required and named, streamed and not, parsed into `tool_calls` the openai
client reads, a tool loop (the call, the tool's answer, a text reply), and the model card."""
from __future__ import annotations

import json
import signal

import jsonschema
import pytest
from server_client import call, free_port, stream_events, wait_started

from oasiskv.entrypoints.openai.server_process import start_server, stop_server

pytestmark = pytest.mark.server

SCHEMA = {"type": "object", "properties": {
    "fruit": {"type": "string", "maxLength": 12}, "color": {"enum": ["yellow", "red", "green"]},
    "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 3}},
    "required": ["fruit", "color", "sizes"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Name a fruit that is yellow, as JSON."}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    proc = start_server(["--max-model-len", "512", "--log-level", "warning"], "127.0.0.1", port, wait=False,
                        stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    wait_started(url, proc, log)
    yield url
    assert stop_server(proc) in (0, -signal.SIGTERM)
    log.close()


def test_openai_client_json_schema(base):
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused")
    fmt = {"type": "json_schema", "json_schema": {"name": "fruit", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=60,
                                       temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    streamed = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=60,
                                              temperature=0, response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == r.choices[0].message.content
    banana = [{"role": "user", "content": "Describe a banana as a JSON object with keys name and color."}]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=banana, max_tokens=60,
                                       temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_guided_fields_on_completions(base):
    status, r = call(base, "/v1/completions", {"prompt": "Is a lemon yellow? Answer:", "max_tokens": 10,
                                               "temperature": 0, "guided_choice": ["yes", "no"]})
    assert status == 200 and r["choices"][0]["text"] in ("yes", "no"), r
    status, r = call(base, "/v1/completions", {"prompt": "A lemon as JSON:", "max_tokens": 60, "temperature": 0,
                                               "guided_json": SCHEMA})
    assert status == 200, r
    jsonschema.validate(json.loads(r["choices"][0]["text"]), SCHEMA)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tools_with_tool_choice_none(base):
    status, r = call(base, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "tools": TOOLS,
                                                    "tool_choice": "none", "store": False, "metadata": {"a": "b"}})
    assert status == 200 and r["choices"][0]["message"]["content"], r
    assert "tool_calls" not in r["choices"][0]["message"]


def _streamed_calls(stream) -> tuple[str, dict[int, dict], str]:
    """(content, calls by index, finish_reason) accumulated from chunks as an openai client user does."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            acc = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            acc["id"] = tc.id or acc["id"]
            acc["name"] += (tc.function.name or "") if tc.function else ""
            acc["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("tool_choice", [  # "required" differs in its grammar only (test_tool_parsers.py)
    pytest.param("required", marks=pytest.mark.slow), {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"])
def test_forced_tool_calls_and_a_tool_loop(base, tool_choice):
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused")
    kw = dict(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=80,
              temperature=0, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    tc = choice.message.tool_calls[0]
    assert tc.id.startswith("call_") and tc.type == "function"
    args = json.loads(tc.function.arguments)
    if isinstance(tool_choice, dict):
        assert tc.function.name == "get_weather"
    jsonschema.validate(args, WEATHER if tc.function.name == "get_weather" else TOOLS[1]["function"]["parameters"])

    content, calls, finish = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and not content and list(calls) == [0]
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == (tc.function.name, args)
    assert calls[0]["id"].startswith("call_")
    with client.chat.completions.stream(**kw) as events:  # the client's own accumulation of a stream
        final = events.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.tool_calls[0].function.arguments == tc.function.arguments

    # The loop: the call and the tool's answer go back; the model answers in text.
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=history, tools=TOOLS,
                                           max_tokens=20, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    streamed = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=history, tools=TOOLS,
                                              max_tokens=20, temperature=0, stream=True)
    assert _streamed_calls(streamed)[0] == reply.choices[0].message.content


def test_each_of_n_choices_calls_the_named_tool(base):
    """n = 2 sampled choices under a named tool_choice: each is its own forced call with its own
    id and arguments that match the schema, whole and streamed (calls keyed by choice index)."""
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 60, "temperature": 0.8, "seed": 3, "n": 2, "parallel_tool_calls": False}
    status, r = call(base, "/v1/chat/completions", body)
    assert status == 200, r
    assert [c["index"] for c in r["choices"]] == [0, 1]
    ids = set()
    for c in r["choices"]:
        assert c["finish_reason"] == "tool_calls" and len(c["message"]["tool_calls"]) == 1, c
        tc = c["message"]["tool_calls"][0]
        assert tc["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(tc["function"]["arguments"]), WEATHER)
        ids.add(tc["id"])
    assert len(ids) == 2
    calls: dict[int, dict] = {}
    for event in stream_events(base, "/v1/chat/completions", body)[:-1]:
        for c in event["choices"]:
            for tc in c["delta"].get("tool_calls") or []:
                got = calls.setdefault(c["index"], {"name": "", "arguments": ""})
                got["name"] += tc.get("function", {}).get("name") or ""
                got["arguments"] += tc.get("function", {}).get("arguments") or ""
    assert sorted(calls) == [0, 1]
    for got in calls.values():
        assert got["name"] == "get_weather"
        jsonschema.validate(json.loads(got["arguments"]), WEATHER)


def test_parallel_calls_and_the_model_card(base):
    status, r = call(base, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                                    "max_tokens": 100, "temperature": 0})
    assert status == 200, r
    message = r["choices"][0]["message"]  # calls until the model ends them or max_tokens cuts the last
    assert r["choices"][0]["finish_reason"] in ("tool_calls", "length")
    assert message["content"] is None and len(message["tool_calls"]) >= 1
    assert len({c["id"] for c in message["tool_calls"]}) == len(message["tool_calls"])
    for c in message["tool_calls"]:
        assert isinstance(json.loads(c["function"]["arguments"]), dict)
    card = call(base, "/v1/models")[1]["data"][0]
    assert card["tool_call_parser"] == "hermes" and card["structured_output_backend"] == "llguidance"
    assert set(card["tool_call_parsers"]) == {"hermes", "llama3_json"}
