"""Tool parsers without a model: text to tool calls, the streamed split, the parser a template
picks, and their forcing grammars (compiled with the default model's tokenizer: a call with the
right name and arguments passes, a wrong name or argument does not)."""
from __future__ import annotations

import json

import pytest

from oasiskv.engine.structured_output import Grammars
from oasiskv.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from oasiskv.entrypoints.openai.tool_parsers import PARSERS, pick_parser
from oasiskv.entrypoints.openai.tool_stream import ToolCallStream
from oasiskv.entrypoints.openai.tools import chat_tools

HERMES, LLAMA = PARSERS["hermes"], PARSERS["llama3_json"]
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                           "required": ["zone"]}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]


def test_hermes_parses_calls_and_content():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n' \
           '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    content, calls = HERMES.parse(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert HERMES.parse("no calls here") == ("no calls here", [])
    assert HERMES.parse("<tool_call>\n{not json\n</tool_call>")[1] == []  # left as text
    unterminated = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'  # cut by max_tokens
    assert HERMES.parse(unterminated)[0] is None and HERMES.parse(unterminated)[1][0].name == "get_time"
    cut = text + '\n<tool_call>\n{"name": "get_time", "argu'  # the complete calls before a cut one stand
    assert [c.name for c in HERMES.parse(cut)[1]] == ["get_weather", "get_time"]
    assert HERMES.parse('<tool_call>\n{"name": "get_time", "argu')[1] == []  # nothing complete: text


def test_llama3_json_parses_calls_only_when_the_reply_is_calls():
    content, calls = LLAMA.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                                 '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}')
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Oslo", "unit": "C"}
    assert LLAMA.parse("The answer is {1}.") == ("The answer is {1}.", [])
    assert LLAMA.parse('{"a": 1}')[1] == []  # a JSON object that is not a call


def test_pick_parser_from_template():
    assert pick_parser("{{ '<|start_header_id|>' }}") is LLAMA
    assert pick_parser("{{ '<|im_start|>' }}") is HERMES and pick_parser(None) is HERMES


@pytest.mark.parametrize("forced", [False, True])
def test_stream_split_holds_back_a_call(forced):
    s = ToolCallStream(HERMES, forced=forced, parallel=True)
    pieces = ["Sure", ". <tool", '_call>\n{"name": "get_time", ', '"arguments": {"zone": "UTC"}}\n</tool_call>']
    sent = "".join(s.content(p) for p in pieces)
    assert sent == ("" if forced else "Sure. ")
    rest, calls = s.finish()
    assert rest == "" and [c.name for c in calls] == ["get_time"]
    plain = ToolCallStream(HERMES, forced=False, parallel=True)
    assert plain.content("a <tool") == "a " and plain.finish() == ("<tool", [])  # not a call after all


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_tool_choice_forms():
    assert chat_tools(_req(tools=TOOLS)).choice == "auto"
    named = chat_tools(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                            parallel_tool_calls=False))
    assert named.choice == "named" and [f["name"] for f in named.functions] == ["get_time"] and not named.parallel
    bad = [dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
           dict(tools=TOOLS, tool_choice="sometimes"),
           dict(tools=[{"type": "retrieval"}], tool_choice="auto"),
           dict(tool_choice="required"),
           dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
           dict(tools=[{"type": "function", "function": {"name": "has space"}}])]
    for kw in bad:
        with pytest.raises(APIError) as e:
            chat_tools(_req(**kw))
        assert e.value.status == 400 and e.value.param in ("tools", "tool_choice"), kw
    with pytest.raises(APIError, match="nope"):
        chat_tools(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}))


@pytest.fixture(scope="module")
def grammars():
    from oasiskv.models.loader import resolve_model
    from oasiskv.models.tokenizer import load_tokenizer

    source = resolve_model(None)
    tok = load_tokenizer(source)
    return Grammars(tok, source.config.vocab_size, source.config.eos_token_ids)


@pytest.mark.parametrize("parser", [HERMES, LLAMA], ids=lambda p: p.name)
def test_forcing_grammar_takes_the_calls_it_allows(grammars, parser):
    use = chat_tools(_req(tools=TOOLS, tool_choice="required"))
    key = "arguments" if parser is HERMES else "parameters"

    def call(name: str, args: dict) -> str:
        body = '{"name": "' + name + f'", "{key}": ' + json.dumps(args, separators=(",", ":")) + "}"
        return f"<tool_call>\n{body}\n</tool_call>" if parser is HERMES else body

    def takes(text: str, parallel: bool = True) -> bool:
        use.parallel = parallel
        g = grammars.matcher(use.grammar(parser, grammars.tokenizer))
        ids = grammars.tokenizer.encode(text, add_special_tokens=False) + grammars.stop_ids[:1]
        return g.matcher.validate_tokens(ids) == len(ids)

    one = call("get_weather", {"city": "Paris", "unit": "C"})
    two = one + ("\n" if parser is HERMES else "; ") + call("get_time", {"zone": "UTC"})
    assert takes(one) and takes(two) and takes(one, parallel=False)
    assert not takes(two, parallel=False)
    assert not takes(call("get_wether", {"city": "Paris", "unit": "C"}))
    assert not takes(call("get_weather", {"city": "Paris", "unit": "K"}))
    assert not takes("Sure! " + one)
