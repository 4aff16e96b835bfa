"""POST /v1/chat/completions: the messages through the model's chat template, n choices, and
OpenAI's chat logprobs (`content: [{token, logprob, bytes, top_logprobs}]`), whole or streamed."""
from __future__ import annotations

import logging
import time
import uuid

from fastapi import Request

from oasiskv.entrypoints.openai.choice import Choice
from oasiskv.entrypoints.openai.protocol import APIError, ChatCompletionRequest, error_body
from oasiskv.entrypoints.openai.serving import EventStream, OpenAIServing, sse, usage
from oasiskv.entrypoints.openai.tools import chat_tools

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
    structured = await serving.structured_output(req)
    prompt = await serving.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                       req.chat_template_kwargs, tools)
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
        return EventStream(_events(serving, req, head, choices, len(ids), top), serving, choices)

    await serving.collect(choices, raw)
    body = [{"index": c.index, "message": {"role": "assistant", "content": c.text.text},
             "logprobs": chat_logprobs(serving, c.token_ids, c.logprobs, top) if req.logprobs else None,
             "finish_reason": c.finish_reason} for c in choices]
    completion = sum(len(c.token_ids) for c in choices)
    out = {**head, "choices": body, "usage": usage(len(ids), completion, choices[0].num_cached_tokens)}
    transfer = serving.transfer_result(choices)
    return out if transfer is None else {**out, "kv_transfer_params": transfer}


async def _events(serving: OpenAIServing, req: ChatCompletionRequest, head: dict, choices: list[Choice],
                  prompt_tokens: int, top: int):
    def counts() -> dict:
        return usage(prompt_tokens, sum(len(c.token_ids) for c in choices), choices[0].num_cached_tokens)

    def chunk(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> str:
        body = {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish_reason}]}
        return sse(body | {"usage": counts()} if req.continuous_usage else body)

    try:
        for c in choices:
            yield chunk(c.index, {"role": "assistant", "content": ""})
        async for u in serving.merged(choices):
            if u.error:
                yield sse(error_body(u.error, "server_error"))
                break
            logprobs = chat_logprobs(serving, u.token_ids, u.logprobs, top) if req.logprobs else None
            yield chunk(u.index, {"content": u.text}, logprobs, u.finish_reason)
        else:
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": counts()})
    except Exception:  # a bug while formatting fails this stream only, and still ends it cleanly
        log.exception("stream %s failed", head["id"])
        yield sse(error_body("internal error", "server_error"))
    yield sse("[DONE]")
