"""Structured output and tool calls through the disaggregation proxy: a prefill server, a
decode server and `oasiskv proxy` as subprocesses on the default model with short prompts. The
prefill samples the first token under the request's grammar; the decode side starts the same
grammar past that token, so the whole output validates (JSON schema, a forced tool call,
streamed and not)."""
from __future__ import annotations

import json
import os

import jsonschema
import pytest
from server_client import call, free_port, start_proxy

from oasiskv.entrypoints.disagg_trust import SECRET_ENV
from oasiskv.entrypoints.openai.server_process import start_server, stop_server, wait_for_health

pytestmark = [pytest.mark.slow, pytest.mark.server]

ENGINE = ["--max-model-len", "1024", "--sparse", "--top-k-blocks", "8", "--sparse-threshold", "256",
          "--host-kv-gb", "0.1", "--kv-cache-gb", "0.1", "--disable-log-stats", "--kv-transport", "socket",
          "--log-level", "warning"]
HOST = "127.0.0.1"
SCHEMA = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 12},
                                           "color": {"enum": ["yellow", "red", "green"]}},
          "required": ["fruit", "color"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
    "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def proxy():
    ports = {name: free_port() for name in ("prefill", "decode", "proxy")}
    url = {name: f"http://{HOST}:{port}" for name, port in ports.items()}
    os.environ.setdefault(SECRET_ENV, "tests-disagg-secret")
    procs = {"prefill": start_server([*ENGINE, "--role", "prefill"], HOST, ports["prefill"], wait=False),
             "decode": start_server([*ENGINE, "--role", "decode", "--prefill-peers", url["prefill"]], HOST,
                                    ports["decode"], wait=False),
             "proxy": start_proxy(url["prefill"], url["decode"], ports["proxy"])}
    try:
        for name, proc in procs.items():
            wait_for_health(url[name], 600, proc)
        yield url["proxy"]
    finally:
        for proc in procs.values():
            stop_server(proc, timeout=30)


def test_json_schema_and_a_forced_tool_call_through_the_proxy(proxy):
    from openai import OpenAI

    client = OpenAI(base_url=proxy + "/v1", api_key="unused")
    fmt = {"type": "json_schema", "json_schema": {"name": "fruit", "schema": SCHEMA, "strict": True}}
    ask = [{"role": "user", "content": "Name a fruit that is yellow, as JSON."}]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ask, max_tokens=40, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    status, out = call(proxy, "/v1/completions", {"prompt": "Is a lemon yellow? Answer:", "max_tokens": 5,
                                                  "temperature": 0, "guided_choice": ["yes", "no"]})
    assert status == 200 and out["choices"][0]["text"] in ("yes", "no"), out

    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="SmolLM2-135M-Instruct", messages=weather, tools=TOOLS, max_tokens=40, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    call_ = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call_.function.name == "get_weather"
    jsonschema.validate(json.loads(call_.function.arguments), TOOLS[0]["function"]["parameters"])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [tc.function.arguments for tc in streamed] == [call_.function.arguments]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
