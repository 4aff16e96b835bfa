"""Structured output through the server: response_format with the official openai client (chat,
streamed too) and vLLM's guided_* on /v1/completions; each output validates. And `tools` with
`tool_choice` "none", rendered through the chat template."""
from __future__ import annotations

import json
import signal

import jsonschema
import pytest
from server_client import call, free_port, wait_started

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


def test_tools_with_tool_choice_none(base):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    status, r = call(base, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "tools": tools,
                                                    "tool_choice": "none"})
    assert status == 200 and r["choices"][0]["message"]["content"], r
