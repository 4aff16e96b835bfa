"""POST /v1/chat/completions: the messages through the model's chat template, n choices, and
OpenAI's chat logprobs (`content: [{token, logprob, bytes, top_logprobs}]`), whole or streamed;
with `tools`, each choice's text parsed into `tool_calls` by the model's tool parser."""
from __future__ import annotations

import logging
import time
import uuid

from fastapi import Request

from oasiskv.entrypoints.openai.choice import Choice
from oasiskv.entrypoints.openai.protocol import APIError, ChatCompletionRequest, error_body
from oasiskv.entrypoints.openai.serving import EventStream, OpenAIServing, sse, usage
from oasiskv.entrypoints.openai.tool_stream import ToolCallStream
from oasiskv.entrypoints.openai.tools import ToolUse, chat_tools

log = logging.getLogger("oasiskv.server")


def chat_logprobs(serving: OpenAIServing, token_ids: list[int], dists: list[dict[int, float]], top: int) -> dict:
    def entry(tok: int, lp: float) -> dict:
        s = serving.token_text(tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for tok, dist in zip(token_ids, dists):
        best = sorted(dist.items(), key=lambda kv: kv[1], reverse=True)[:top]
        content.append({**entry(tok, dist[tok]), "top_logprobs": [entry(t, lp) for t, lp in best]})
    return {"content": content}


async def create_chat_completion(serving: OpenAIServing, req: ChatCompletionRequest, raw: Request):
    serving.check_model(req.model)
    serving.check_supported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "`top_logprobs` needs `logprobs`: true", param="top_logprobs")
    tools = chat_tools(req)
    if tools is not None and tools.forced:
        # the grammar holds nothing from the request but the functions' names and `parameters`
        structured = await serving.check_grammar(tools.grammar(serving.tool_parser, serving.tokenizer), "tools")
    else:
        structured = await serving.structured_output(req)
    prompt = await serving.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                       req.chat_template_kwargs, tools.tools if tools is not None else None)
    ids = await serving.encode(prompt, "messages")
    max_tokens = serving.max_new_tokens(len(ids), req.max_new_tokens, "messages")
    top = req.top_logprobs or 0
    logprobs = top if req.logprobs else None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    specs = [(j, f"{rid}-{j}", ids, serving.sampling_params(req, max_tokens, j, logprobs, structured=structured),
              req.text_options())
             for j in range(req.n)]
    choices = await serving.start(specs, req.kv_transfer_params, req.stream)
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": serving.model_name}
    if req.stream:
        head["object"] = "chat.completion.chunk"
        return EventStream(_events(serving, req, head, choices, len(ids), top, tools), serving, choices)

    await serving.collect(choices, raw)
    body = []
    for c in choices:
        message, finish = _message(serving, c, tools)
        body.append({"index": c.index, "message": message, "finish_reason": finish,
                     "logprobs": chat_logprobs(serving, c.token_ids, c.logprobs, top) if req.logprobs else None})
    completion = sum(len(c.token_ids) for c in choices)
    out = {**head, "choices": body, "usage": usage(len(ids), completion, choices[0].num_cached_tokens)}
    transfer = serving.transfer_result(choices)
    return out if transfer is None else {**out, "kv_transfer_params": transfer}


def _message(serving: OpenAIServing, c: Choice, tools: ToolUse | None) -> tuple[dict, str | None]:
    """The choice's message and finish_reason: "tool_calls" when it ended calling tools."""
    if tools is None or not tools.parse:
        return {"role": "assistant", "content": c.text.text}, c.finish_reason
    content, calls = serving.tool_parser.parse(c.text.text)
    if not calls:
        return {"role": "assistant", "content": c.text.text}, c.finish_reason
    calls = calls if tools.parallel else calls[:1]
    message = {"role": "assistant", "content": content, "tool_calls": [call.to_openai() for call in calls]}
    return message, "tool_calls" if c.finish_reason == "stop" else c.finish_reason


async def _events(serving: OpenAIServing, req: ChatCompletionRequest, head: dict, choices: list[Choice],
                  prompt_tokens: int, top: int, tools: ToolUse | None):
    def counts() -> dict:
        return usage(prompt_tokens, sum(len(c.token_ids) for c in choices), choices[0].num_cached_tokens)

    def chunk(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> str:
        body = {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish_reason}]}
        return sse(body | {"usage": counts()} if req.continuous_usage else body)

    split = {c.index: ToolCallStream(serving.tool_parser, tools.forced, tools.parallel)
             for c in choices} if tools is not None and tools.parse else {}
    try:
        for c in choices:
            yield chunk(c.index, {"role": "assistant", "content": ""})
        async for u in serving.merged(choices):
            if u.error:
                yield sse(error_body(u.error, "server_error"))
                break
            logprobs = chat_logprobs(serving, u.token_ids, u.logprobs, top) if req.logprobs else None
            if u.index not in split:
                yield chunk(u.index, {"content": u.text}, logprobs, u.finish_reason)
                continue
            text, calls = split[u.index].content(u.text), []
            if u.finish_reason is not None:
                rest, calls = split[u.index].finish()
                text += rest
            if text or logprobs:
                yield chunk(u.index, {"content": text}, logprobs)
            for i, call in enumerate(calls):  # one chunk per call: its id, name and whole arguments
                yield chunk(u.index, {"tool_calls": [{"index": i, **call.to_openai()}]})
            if u.finish_reason is not None:
                finish = "tool_calls" if calls and u.finish_reason == "stop" else u.finish_reason
                yield chunk(u.index, {}, None, finish)
        else:
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": counts()})
    except Exception:  # a bug while formatting fails this stream only, and still ends it cleanly
        log.exception("stream %s failed", head["id"])
        yield sse(error_body("internal error", "server_error"))
    yield sse("[DONE]")
