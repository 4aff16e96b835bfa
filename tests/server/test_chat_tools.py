"""Tools through Qwen2.5's chat template (SmolLM2's ignores tools, so this needs the downloaded
Qwen2.5-Coder; the tokenizer only): the definitions in the system turn, a call and the tool's
answer in the history as the model reads them, and the forcing grammar on Qwen's own
`<tool_call>` tokens."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from oasiskv.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from oasiskv.entrypoints.openai.serving import OpenAIServing
from oasiskv.entrypoints.openai.tools import chat_tools
from oasiskv.models.downloads import DOWNLOADS
from oasiskv.models.loader import resolve_model
from oasiskv.models.tokenizer import load_tokenizer

MODEL = "qwen2.5-coder-0.5b"
pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not DOWNLOADS[MODEL].path.is_file(), reason=f"{MODEL} not downloaded")]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def serving():
    source = resolve_model(MODEL)
    engine = SimpleNamespace(max_model_len=512, tokenizer=load_tokenizer(source),
                             runner=SimpleNamespace(model_config=source.config))
    return OpenAIServing(SimpleNamespace(engine=engine), MODEL)


def test_tools_are_rendered_by_the_template(serving):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    req = ChatCompletionRequest(messages=messages, tools=TOOLS, tool_choice="none")
    with_tools = asyncio.run(serving.chat_prompt([ChatMessage(**m) for m in messages], tools=chat_tools(req).tools))
    without = asyncio.run(serving.chat_prompt([ChatMessage(**m) for m in messages]))
    assert "get_weather" in with_tools and "get_weather" not in without
    assert serving.tool_parser.name == "hermes"


def test_a_call_and_its_answer_in_the_history(serving):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'}]
    prompt = asyncio.run(serving.chat_prompt([ChatMessage(**m) for m in messages], tools=TOOLS))
    # the arguments as an object (not a JSON string inside JSON), the answer in a tool response
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temperature": 18}\n</tool_response>' in prompt


def test_forcing_grammar_uses_qwens_call_tokens(serving):
    tok = serving.tokenizer
    use = chat_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                           tool_choice="required"))
    grammar = use.grammar(serving.tool_parser, tok).spec
    assert f"<[{tok.convert_tokens_to_ids('<tool_call>')}]>" in grammar
    assert f"<[{tok.convert_tokens_to_ids('</tool_call>')}]>" in grammar
