"""The OpenAI wire format: request bodies (validated by pydantic) and the error body.

Only what the engine can honour is accepted: one choice per request (`n` = 1), no logprobs.
Extensions vLLM users know are accepted too: `top_k`, `ignore_eos`, `stop_token_ids`, and a
completion `prompt` given as a list of token ids (so dummy-weight models need no tokenizer).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from oasiskv.sampling_params import SamplingParams


class APIError(Exception):
    """An error the client caused (4xx) or the server hit (5xx), sent as OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share."""
    model: str | None = None  # None = the one model this server holds (as vLLM)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | bool | None = None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams, with its ValueError turned into a 400 that names the bad field."""
        if self.n != 1:
            raise APIError(400, f"only n=1 is supported, got n={self.n}", param="n")
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        try:
            return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                  max_tokens=max_tokens, seed=self.seed, stop=self.stop,
                                  stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos)
        except ValueError as e:
            message = str(e)
            # SamplingParams' messages start with the field's name ("temperature must be >= 0 ...").
            param = next((f for f in ("max_tokens", "temperature", "top_p", "top_k", "stop")
                          if message.startswith(f)), None)
            raise APIError(400, message, param=param, code="invalid_value") from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]  # one prompt: text, or token ids
    max_tokens: int | None = 16  # OpenAI's default for completions


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
