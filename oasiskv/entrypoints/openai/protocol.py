"""The OpenAI wire format: request bodies (validated by pydantic) and the error body.

Models are strict, as vLLM's are: a string is never read as a number or a bool, NaN and
infinity are refused, every number has bounds, and an unknown top-level field is a 400 naming it
(a typo such as `max_token` would otherwise be ignored silently). Fields OpenAI defines that the
server does not implement are declared, so the 400 can say "not supported" instead of "unknown".
Bounds that depend on the model (vocabulary, model length) are checked in serving.py.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from oasiskv.entrypoints.openai.detokenizer import TextOptions

MAX_N = 16  # choices per prompt (n, best_of)
MAX_PROMPTS = 256  # prompts in one batched completion request
MAX_CHOICES = 256  # engine requests one HTTP request may start (prompts x best_of)
MAX_STOP = 16  # stop strings
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MIN_TEMPERATURE = 1e-5  # below it logits / temperature overflow and sampling turns NaN


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


def _no_lone_surrogates(s: str) -> str:
    """JSON's \\ud83d escape without its pair decodes to a str no tokenizer can encode."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)") from None
    return s


Text = Annotated[str, AfterValidator(_no_lone_surrogates)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Count = Annotated[int, Field(ge=1, le=MAX_N)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the counts so far


# Fields OpenAI or vLLM define that are refused with a 400 naming them (see serving.check_supported).
NOT_SUPPORTED = ("functions", "function_call", "suffix", "guided_grammar", "prompt_logprobs", "audio",
                 "modalities", "prediction", "reasoning_effort", "web_search_options")


class _SamplingFields(_Strict):
    """Fields both endpoints share."""
    model: Text | None = None  # None = the one model this server holds (as vLLM)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1  # <= the vocabulary: checked in serving
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None  # choice i of n takes seed + i (mod 2^63)
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=256)] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] = 1.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token id (as text) -> bias
    n: Count = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # an end-user id for the caller's logs; it changes no output
    # Prefill/decode disaggregation (vLLM's field): what a prefill or decode server does with the
    # request (entrypoints/openai/disagg_serving.py).
    kv_transfer_params: dict[str, Any] | None = None
    # Structured output, read by structured.py (which names what is wrong in a malformed one).
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    # Declared only to be refused by name (serving.check_supported).
    functions: Any = None
    function_call: Any = None
    guided_grammar: Any = None
    prompt_logprobs: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    suffix: Any = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def text_options(self) -> TextOptions:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return TextOptions(stop, self.include_stop_str_in_output, self.skip_special_tokens)


class CompletionRequest(_SamplingFields):
    # One prompt (text or token ids) or a batch of them (texts or token-id lists).
    prompt: (Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: Annotated[int, Field(ge=0)] | None = 16  # OpenAI's default; 0 only with echo
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Count | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(_Strict):
    name: Text
    arguments: Text  # a JSON object, as text


class ToolCallIn(_Strict):
    """A call in an assistant message of the history (one the server returned earlier)."""
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: Text | None = None  # tool messages: the call this answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's: how the messages go through the chat template.
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the prompt ends inside the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (e.g. enable_thinking)
    tools: Any = None  # read by tools.py (which names what is wrong in a malformed one)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # None = true, as OpenAI
    # Accepted and ignored, as vLLM does: nothing is stored, metadata is not kept, one service tier.
    store: bool | None = None
    metadata: dict[str, Text] | None = None
    service_tier: Text | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a completion `prompt`, or chat `messages` through the template."""
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
