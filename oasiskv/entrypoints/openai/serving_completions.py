"""POST /v1/completions: one prompt or a batch, n (or best_of) choices each, echo and the legacy
logprobs shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), whole or streamed.

Choices are numbered prompt-major (prompt i's choices are i*n .. i*n+n-1), as vLLM does.
`echo` with `max_tokens` 0 returns the prompt (and its logprobs) alone: what evaluation tools
ask for to score a text.
"""
from __future__ import annotations

import logging
import time
import uuid

from fastapi import Request

from oasiskv.entrypoints.openai.choice import Choice
from oasiskv.entrypoints.openai.protocol import MAX_CHOICES, APIError, CompletionRequest, error_body
from oasiskv.entrypoints.openai.serving import EventStream, OpenAIServing, sse, usage

log = logging.getLogger("oasiskv.server")


class LegacyLogprobs:
    """The completions API's logprobs object, built token by token (text_offset runs on)."""

    def __init__(self, serving: OpenAIServing, offset: int = 0):
        self.serving, self.offset = serving, offset

    def build(self, token_ids: list[int], dists: list[dict[int, float] | None]) -> dict:
        text = self.serving.token_text
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, dist in zip(token_ids, dists):
            s = text(tok)
            out["tokens"].append(s)
            out["token_logprobs"].append(None if dist is None else dist[tok])
            out["top_logprobs"].append(None if dist is None else {text(t): lp for t, lp in dist.items()})
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out


async def create_completion(serving: OpenAIServing, req: CompletionRequest, raw: Request):
    serving.check_model(req.model)
    serving.check_supported(req)
    best_of = req.best_of if req.best_of is not None else req.n
    if best_of < req.n:
        raise APIError(400, f"`best_of` ({best_of}) must be at least `n` ({req.n})", param="best_of")
    if req.stream and best_of > req.n:
        raise APIError(400, "`best_of` > `n` cannot be streamed", param="best_of")
    if req.stream and req.echo:
        raise APIError(400, "`echo` is not supported with `stream`", param="echo")
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "`max_tokens` must be at least 1 (0 only with `echo`)", param="max_tokens")
    prompts = req.prompts()
    if len(prompts) * best_of > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts x {best_of} choices is more than {MAX_CHOICES} engine requests "
                            "in one request", param="n")
    structured = await serving.structured_output(req)
    prompt_ids = [p if isinstance(p, list) else await serving.encode(p) for p in prompts]
    for ids in prompt_ids:
        if any(t >= serving.vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must be integers in [0, {serving.vocab_size})", param="prompt")
    # best_of ranks by cumulative logprob, so the engine must compute logprobs even if not returned.
    logprobs = req.logprobs if req.logprobs is not None else (0 if best_of > req.n else None)
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    rid = f"cmpl-{uuid.uuid4().hex}"
    specs = []
    for i, ids in enumerate(prompt_ids):
        # echo with max_tokens 0: generate one token and drop it (the engine always samples one).
        max_tokens = serving.max_new_tokens(len(ids), max(req.max_tokens, 1) if req.max_tokens is not None
                                            else None, "prompt")
        for j in range(best_of):
            params = serving.sampling_params(req, max_tokens, j, logprobs, prompt_logprobs, structured)
            specs.append((i * best_of + j, f"{rid}-{i}-{j}", ids, params, req.text_options()))
    choices = await serving.start(specs, req.kv_transfer_params, req.stream)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": serving.model_name}
    if req.stream:
        return EventStream(_events(serving, req, head, choices, prompt_ids), serving, choices)

    await serving.collect(choices, raw)
    kept = []
    for i in range(len(prompt_ids)):
        group = choices[i * best_of:(i + 1) * best_of]
        if best_of > req.n:  # the n best by cumulative logprob (vLLM's best_of)
            group = sorted(group, key=lambda c: c.cumulative_logprob, reverse=True)[:req.n]
        kept += [(i * req.n + k, i, c) for k, c in enumerate(group)]
    body = [await _choice_body(serving, req, index, prompt_ids[i], prompts[i], c) for index, i, c in kept]
    completion = 0 if req.max_tokens == 0 else sum(len(c.token_ids) for _, _, c in kept)
    prompt_tokens = sum(len(ids) for ids in prompt_ids)
    out = {**head, "choices": body, "usage": usage(prompt_tokens, completion, _cached(choices, best_of))}
    transfer = serving.transfer_result(choices)
    return out if transfer is None else {**out, "kv_transfer_params": transfer}


def _cached(choices: list[Choice], per_prompt: int) -> int:
    """Prompt tokens found in the prefix cache, once per prompt (its first choice's)."""
    return sum(c.num_cached_tokens for c in choices[::per_prompt])


async def _choice_body(serving: OpenAIServing, req: CompletionRequest, index: int, prompt_ids: list[int],
                       prompt: str | list[int], c: Choice) -> dict:
    generated = req.max_tokens != 0
    text = c.text.text if generated else ""
    finish = c.finish_reason if generated else "length"
    prefix = ""
    if req.echo:
        prefix = prompt if isinstance(prompt, str) else await serving.decode(prompt_ids)
    logprobs = None
    if req.logprobs is not None:
        legacy = LegacyLogprobs(serving)
        tokens, dists = [], []
        if req.echo:
            tokens, dists = list(prompt_ids), list(c.prompt_logprobs or [None] * len(prompt_ids))
        if generated:
            tokens, dists = tokens + c.token_ids, dists + c.logprobs
        logprobs = legacy.build(tokens, dists)
    return {"index": index, "text": prefix + text, "logprobs": logprobs, "finish_reason": finish}


async def _events(serving: OpenAIServing, req: CompletionRequest, head: dict, choices: list[Choice],
                  prompt_ids: list[list[int]]):
    offsets = {c.index: LegacyLogprobs(serving) for c in choices}
    p = sum(len(ids) for ids in prompt_ids)

    def counts() -> dict:
        return usage(p, sum(len(c.token_ids) for c in choices), _cached(choices, req.n))

    try:
        async for u in serving.merged(choices):
            if u.error:
                yield sse(error_body(u.error, "server_error"))
                break
            logprobs = offsets[u.index].build(u.token_ids, u.logprobs) if req.logprobs is not None else None
            chunk = {**head, "choices": [{"index": u.index, "text": u.text, "logprobs": logprobs,
                                          "finish_reason": u.finish_reason}]}
            yield sse(chunk | {"usage": counts()} if req.continuous_usage else chunk)
        else:
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": counts()})
    except Exception:  # a bug while formatting fails this stream only, and still ends it cleanly
        log.exception("stream %s failed", head["id"])
        yield sse(error_body("internal error", "server_error"))
    yield sse("[DONE]")
