"""`tools` reach the chat template (with `tool_choice` "none"): Qwen2.5's template renders them
into the system turn. SmolLM2's ignores tools, so this needs the downloaded Qwen2.5-Coder."""
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


def test_tools_are_rendered_by_the_template():
    source = resolve_model(MODEL)
    engine = SimpleNamespace(max_model_len=512, tokenizer=load_tokenizer(source),
                             runner=SimpleNamespace(model_config=source.config))
    serving = OpenAIServing(SimpleNamespace(engine=engine), MODEL)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    req = ChatCompletionRequest(messages=messages, tools=TOOLS, tool_choice="none")
    with_tools = asyncio.run(serving.chat_prompt([ChatMessage(**m) for m in messages], tools=chat_tools(req)))
    without = asyncio.run(serving.chat_prompt([ChatMessage(**m) for m in messages]))
    assert "get_weather" in with_tools and "get_weather" not in without
