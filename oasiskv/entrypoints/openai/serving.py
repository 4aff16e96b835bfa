"""Completions and chat completions: a request body in, the engine's outputs out as one JSON
response or as server-sent events (`data: {chunk}` lines, then `data: [DONE]`), as OpenAI sends.

A request whose client goes away is aborted at once, so its pages and host extent come back.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from oasiskv.engine.async_engine import AsyncEngine, EngineStopped, RequestStream
from oasiskv.engine.llm_engine import RequestOutput
from oasiskv.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body


class TextDeltas:
    """Turns each output's full text into the new piece to send. Holds back what may still
    change: a trailing half of a UTF-8 character (decoded as U+FFFD) and, while stop strings are
    set, the characters that could be the start of one (the engine cuts a stop string out)."""

    def __init__(self, stop: list[str]):
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def next(self, out: RequestOutput) -> str:
        text = out.text
        if not out.finished:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - self.hold] if self.hold else text
        if len(text) <= self.sent:
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta


def usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.engine.max_model_len
        self.tokenizer = engine.engine.tokenizer

    # ---- the two endpoints --------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request):
        self._check_model(req.model)
        # Without max_tokens the engine stops at the model length.
        params = req.sampling_params(req.max_tokens if req.max_tokens is not None else self.max_model_len)
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = await self._submit(req.prompt, params, rid)
        created = int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}

        def choice(text: str, out: RequestOutput) -> dict:
            return {"index": 0, "text": text, "logprobs": None,
                    "finish_reason": out.finish_reason if out.finished else None}

        if not req.stream:
            out = await self._last_output(stream, raw)
            return {**head, "choices": [choice(out.text, out)], "usage": usage(out)}

        async def events():
            deltas, out = TextDeltas(params.stop), None
            async for out in self._guarded(stream):
                if isinstance(out, dict):  # an error after the stream began
                    yield sse(out)
                    break
                yield sse({**head, "choices": [choice(deltas.next(out), out)]})
            if req.include_usage and isinstance(out, RequestOutput):
                yield sse({**head, "choices": [], "usage": usage(out)})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self._check_model(req.model)
        prompt = self._apply_chat_template(req)
        max_tokens = req.max_new_tokens if req.max_new_tokens is not None else self.max_model_len
        params = req.sampling_params(max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self._submit(prompt, params, rid)
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name}

        if not req.stream:
            out = await self._last_output(stream, raw)
            message = {"role": "assistant", "content": out.text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": out.finish_reason}
            return {**head, "choices": [choice], "usage": usage(out)}

        head["object"] = "chat.completion.chunk"

        def chunk(delta: dict, finish_reason: str | None = None) -> str:
            return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": finish_reason}]})

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            deltas, out = TextDeltas(params.stop), None
            async for out in self._guarded(stream):
                if isinstance(out, dict):
                    yield sse(out)
                    break
                yield chunk({"content": deltas.next(out)}, out.finish_reason if out.finished else None)
            if req.include_usage and isinstance(out, RequestOutput):
                yield sse({**head, "choices": [], "usage": usage(out)})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- shared steps -------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.model_name}`.", param="model", code="model_not_found")

    def _apply_chat_template(self, req: ChatCompletionRequest) -> str:
        tok = self.tokenizer
        if tok is None or not tok.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template rejects the conversation (e.g. a bad role order)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    async def _submit(self, prompt, params, rid: str) -> RequestStream:
        try:
            return await self.engine.add_request(prompt, params, rid)
        except ValueError as e:  # the engine's own checks: empty or too long prompt, bad ids
            raise APIError(400, str(e), param="prompt" if "prompt" in str(e) else None) from None
        except EngineStopped as e:
            raise APIError(503, str(e), type="service_unavailable") from None

    async def _guarded(self, stream: RequestStream):
        """The stream's outputs; an engine failure becomes one error body; leaving early (the
        client went away, so the response task is cancelled) aborts the request."""
        try:
            async for out in stream:
                yield out
        except EngineStopped as e:
            yield error_body(str(e), "service_unavailable")
        finally:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    async def _last_output(self, stream: RequestStream, raw: Request) -> RequestOutput:
        """Wait for the final output, aborting the request if the client disconnects first."""

        async def last():
            out = None
            async for out in stream:
                pass
            return out

        collect = asyncio.ensure_future(last())
        gone = asyncio.ensure_future(until_disconnected(raw))
        try:
            await asyncio.wait([collect, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                self.engine.abort(stream.request_id)
        if collect.cancelled():
            raise APIError(499, "the client closed the request", code="client_closed")
        try:
            return collect.result()
        except EngineStopped as e:
            raise APIError(503, str(e), type="service_unavailable") from None


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)
