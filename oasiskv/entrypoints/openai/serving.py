"""What both generation endpoints share: checks that need the model (vocabulary, length),
tokenizing in a worker thread, SamplingParams per choice, submitting the choices, and
collecting them (one JSON response) or merging their updates (server-sent events).

A request whose client goes away is aborted at once, so its pages and host extent come back.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from oasiskv.disagg.transport import TransportError
from oasiskv.engine.async_engine import AsyncEngine, EngineStopped
from oasiskv.entrypoints.openai.choice import Choice, ChoiceUpdate
from oasiskv.entrypoints.openai.detokenizer import TextOptions
from oasiskv.entrypoints.openai.protocol import (MIN_TEMPERATURE, NOT_SUPPORTED, APIError, ChatMessage,
                                                 _SamplingFields)
from oasiskv.entrypoints.openai.structured import FIELDS as STRUCTURED_FIELDS, structured_output
from oasiskv.entrypoints.openai.tool_parsers import PARSERS, pick_parser
from oasiskv.sampling_params import SamplingParams, StructuredOutput

ENGINE_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# apply_chat_template's own parameters: `chat_template_kwargs` passes template variables only.
TEMPLATE_CALL_ARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                      "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
SEED_MOD = 2**63


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """The response's token counts; `cached_tokens`: prompt tokens found in the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose choices are released however the response ends. The event
    generator's own cleanup covers most ends, but not a cancellation that lands before its first
    step (while the response's headers are sent): then it never ran."""

    def __init__(self, events, serving: "OpenAIServing", choices: list[Choice]):
        super().__init__(events, media_type="text/event-stream")
        self.serving, self.choices = serving, choices

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.serving.release(self.choices)


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _template_message(m: ChatMessage, i: int) -> dict:
    """A message as chat templates read it: a call's arguments as an object (templates write them
    with `tojson`), a tool message with the id of the call it answers."""
    out = {"role": m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        if m.role != "assistant":
            raise APIError(400, f"`messages[{i}]`: only assistant messages carry `tool_calls`", param="messages")
        calls = []
        for call in m.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise APIError(400, f"`messages[{i}].tool_calls`: the arguments of {call.function.name!r} are not "
                                    "a JSON object", param="messages")
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        out["tool_calls"] = calls
    return out


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, disagg=None, tool_parser: str | None = None):
        self.engine = engine
        self.disagg = disagg  # PrefillRole | DecodeRole on a role server (disagg_serving.py)
        self.model_name = model_name
        self.max_model_len = engine.engine.max_model_len
        self.vocab_size = engine.engine.runner.model_config.vocab_size
        self.tokenizer = engine.engine.tokenizer
        # One worker: HF tokenizers are not safe to call from several threads at once. The
        # tokenizer routes (/tokenize, /detokenize: open, and fed whole documents by evaluation
        # tools) take a copy of their own on a worker of their own, so they never queue ahead of
        # a generation request's prompt.
        self.tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="oasiskv-tokenizer")
        self.utility_tokenizer = copy.deepcopy(self.tokenizer)
        self.utility_pool = ThreadPoolExecutor(1, thread_name_prefix="oasiskv-tokenizer-routes")
        # The longest text one token can stand for: a text longer than max_model_len of them
        # cannot fit, and is refused without spending the tokenizer's time on it.
        self.max_token_chars = max((len(t) for t in self.tokenizer.convert_ids_to_tokens(
            list(range(len(self.tokenizer))))), default=1) if self.tokenizer is not None else 1
        self.live: set[Choice] = set()  # choices generating now (the shutdown deadline ends them)
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_parser = PARSERS[tool_parser] if tool_parser else pick_parser(template if isinstance(template, str)
                                                                               else None)

    # ---- checks -------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.model_name}`.", param="model", code="model_not_found")

    def check_supported(self, req: _SamplingFields) -> None:
        for name in NOT_SUPPORTED:
            value = getattr(req, name, None)
            if value is None:
                continue
            raise APIError(400, f"`{name}` is not supported by this server", param=name, code="unsupported_parameter")
        if 0 < req.temperature < MIN_TEMPERATURE:
            raise APIError(400, f"`temperature` must be 0 (greedy) or at least {MIN_TEMPERATURE}, got "
                                f"{req.temperature}", param="temperature", code="invalid_value")
        if req.top_k > self.vocab_size:
            raise APIError(400, f"`top_k` must be -1 or 0 (off) or at most the vocabulary size {self.vocab_size}, "
                                f"got {req.top_k}", param="top_k", code="invalid_value")
        if any(t >= self.vocab_size for t in req.stop_token_ids or []):
            raise APIError(400, f"`stop_token_ids` must be token ids below {self.vocab_size}",
                           param="stop_token_ids", code="invalid_value")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "`stream_options` needs `stream`: true", param="stream_options")
        self.logit_bias(req)

    def logit_bias(self, req: _SamplingFields) -> dict[int, float] | None:
        if not req.logit_bias:
            return None
        bias = {}
        for key, value in req.logit_bias.items():
            if not key.isdigit() or int(key) >= self.vocab_size:
                raise APIError(400, f"`logit_bias` keys must be token ids in [0, {self.vocab_size}), got {key!r}",
                               param="logit_bias", code="invalid_value")
            bias[int(key)] = value
        return bias

    def max_new_tokens(self, prompt_len: int, max_tokens: int | None, prompt_param: str) -> int:
        """The engine's max_tokens; a prompt or a request that cannot fit the model is a 400 (as vLLM)."""
        if prompt_len >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"the prompt is {prompt_len} tokens, which leaves no room for output.",
                           param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            return self.max_model_len - prompt_len
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                                f"{max_tokens} in the completion). Reduce the prompt or `max_tokens`.",
                           param="max_tokens", code="context_length_exceeded")
        return max_tokens

    async def structured_output(self, req: _SamplingFields) -> StructuredOutput | None:
        """The request's output constraint, compiled once here (off the engine's thread) so that
        a schema the grammar library refuses is a 400 naming the fault."""
        so = structured_output(req)
        if so is None:
            return None
        return await self.check_grammar(so, next(f for f in STRUCTURED_FIELDS if getattr(req, f) is not None))

    async def check_grammar(self, so: StructuredOutput, param: str) -> StructuredOutput:
        """`so` compiled (and cached, so the engine does not compile it again); a 400 on `param` if it fails."""
        try:
            await self._in_pool(self.engine.engine.grammars.check, so)
        except ValueError as e:
            raise APIError(400, f"`{param}`: {e}", param=param, code="invalid_value") from None
        return so

    def sampling_params(self, req: _SamplingFields, max_tokens: int, choice: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None, structured: StructuredOutput | None = None
                        ) -> SamplingParams:
        """Choice `choice`'s SamplingParams. Stop strings stay here (choice.py), not in the engine."""
        if req.min_tokens > max_tokens:
            raise APIError(400, f"`min_tokens` ({req.min_tokens}) must not exceed `max_tokens` ({max_tokens})",
                           param="min_tokens", code="invalid_value")
        fields = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                      max_tokens=max_tokens,
                      seed=None if req.seed is None else (req.seed + choice) % SEED_MOD,
                      stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos)
        optional = dict(min_tokens=req.min_tokens, presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                        logit_bias=self.logit_bias(req), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                        structured=structured)
        defaults = dict(min_tokens=0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
        for name, value in optional.items():
            if value is None or value == defaults.get(name):
                continue
            if name not in ENGINE_FIELDS:  # an engine without this feature: refuse, never ignore
                param = {"prompt_logprobs": "echo", "structured": "response_format"}.get(name, name)
                raise APIError(400, f"`{param}` is not supported by this engine", param=param,
                               code="unsupported_parameter")
            fields[name] = value
        try:
            return SamplingParams(**fields)
        except ValueError as e:  # SamplingParams' messages start with the field's name
            message = str(e)
            param = next((f for f in fields if message.startswith(f)), None)
            raise APIError(400, message, param=param, code="invalid_value") from None

    # ---- tokenizing, off the event loop and off the engine thread --------------------------
    async def _in_pool(self, fn, *args, utility: bool = False):
        pool = self.utility_pool if utility else self.tokenizer_pool
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _need_tokenizer(self, param: str):
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer (dummy weights): send token ids", param=param)
        return self.tokenizer

    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = False,
                     must_fit: bool = True, utility: bool = False) -> list[int]:
        """Token ids; with `must_fit`, a text too long for the model is a 400 before any tokenizing;
        `utility`: for the tokenizer routes (their own tokenizer and worker)."""
        tok = self._need_tokenizer(param)
        tok = self.utility_tokenizer if utility else tok
        if must_fit and len(text) > self.max_model_len * self.max_token_chars:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the "
                                f"{len(text)} characters of the {param} cannot fit in it.",
                           param=param, code="context_length_exceeded")
        return await self._in_pool(lambda: tok.encode(text, add_special_tokens=add_special_tokens), utility=utility)

    async def decode(self, ids: list[int], utility: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        if any(t >= self.vocab_size for t in ids):
            raise APIError(400, f"token ids must be below {self.vocab_size}", param="tokens")
        tok = self.utility_tokenizer if utility else self.tokenizer
        return await self._in_pool(lambda: tok.decode(ids, skip_special_tokens=True), utility=utility)

    async def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, template_kwargs: dict | None = None,
                          tools: list[dict] | None = None) -> str:
        tok = self._need_tokenizer("messages")
        if not tok.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        if continue_final_message and (add_generation_prompt or messages[-1].role != "assistant"):
            raise APIError(400, "`continue_final_message` needs `add_generation_prompt`: false and an assistant "
                                "message last", param="continue_final_message")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(k for k in kwargs if k in TEMPLATE_CALL_ARGS or not k.isidentifier())
        if reserved:
            raise APIError(400, f"`chat_template_kwargs` may not set {', '.join(reserved)}",
                           param="chat_template_kwargs")
        conversation = [_template_message(m, i) for i, m in enumerate(messages)]
        try:
            return await self._in_pool(lambda: tok.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, **kwargs))
        except Exception as e:  # the template rejects the conversation (e.g. a bad role order)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    # ---- choices ------------------------------------------------------------------------
    async def start(self, specs: list[tuple[int, str, list[int], SamplingParams, TextOptions]],
                    transfer: dict | None = None, stream: bool = False) -> list[Choice]:
        """Submit (index, request id, prompt ids, params, text options) each; all or none.
        `transfer`: the request's kv_transfer_params (a prefill or decode server's request)."""
        if transfer is not None:
            if self.disagg is None:
                raise APIError(400, "`kv_transfer_params` needs a server started with --role prefill or decode",
                               param="kv_transfer_params")
            if len(specs) != 1:
                raise APIError(400, "a disaggregated request has one prompt and one choice", param="n")
            await self.disagg.prepare(specs[0][1], transfer, stream)
        choices = []
        try:
            return await self._start(specs, choices)
        except BaseException:
            if transfer is not None and not choices:  # never reached the engine
                self.disagg.discard(specs[0][1])
            raise

    async def _start(self, specs, choices: list[Choice]) -> list[Choice]:
        try:
            for index, rid, ids, params, text in specs:
                c = Choice(self.engine, index, rid, ids, params, text, self.tokenizer, self.live)
                await c.start()
                choices.append(c)
        except ValueError as e:  # the engine's own checks: empty prompt, bad ids, host pool too small
            self._abort(choices)
            raise APIError(400, str(e), param="prompt" if "prompt" in str(e) else None) from None
        except EngineStopped as e:
            self._abort(choices)
            raise APIError(503, str(e), type="service_unavailable") from None
        except TransportError as e:  # the prefill server of a disaggregated request is gone
            self._abort(choices)
            raise APIError(502, f"the prefill server cannot be reached: {e}", type="server_error") from None
        except BaseException:
            self._abort(choices)
            raise
        return choices

    def _abort(self, choices: list[Choice]) -> None:
        for c in choices:
            self.live.discard(c)
            self.engine.abort(c.request_id)

    def transfer_result(self, choices: list[Choice]) -> dict | None:
        """The kv_transfer_params a prefill server answers with (None elsewhere)."""
        return self.disagg.result(choices[0].request_id) if self.disagg is not None else None

    def release(self, choices: list[Choice]) -> None:
        """Abort the choices whose engine request has not finished (a no-op for the others)."""
        self._abort([c for c in choices if c.stream is None or not c.stream.finished])

    async def collect(self, choices: list[Choice], raw: Request) -> list[Choice]:
        """Run every choice to its end; abort them all if the client disconnects first; a failed
        choice fails the response."""
        work = asyncio.ensure_future(asyncio.gather(*(c.run() for c in choices)))
        # A cancelled gather ends with a CancelledError set as its exception (not as cancelled):
        # retrieve it, or asyncio logs it as never retrieved.
        work.add_done_callback(lambda f: f.cancelled() or f.exception())
        gone = asyncio.ensure_future(until_disconnected(raw))
        try:
            await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            client_left = not work.done()
            if client_left:
                work.cancel()
                self._abort(choices)
        if client_left:
            raise APIError(499, "the client closed the request", code="client_closed")
        work.result()
        failed = next((c for c in choices if c.error), None)
        if failed is not None:
            kind = "service_unavailable" if failed.error_status == 503 else "server_error"
            raise APIError(failed.error_status, failed.error, type=kind)
        return choices

    async def merged(self, choices: list[Choice]):
        """Every choice's updates as they come. Leaving early (the client went away, an error)
        cancels the rest, which aborts their engine requests."""
        updates: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice):
            try:
                async for u in c.updates():
                    updates.put_nowait(u)
            finally:
                updates.put_nowait(None)

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            left = len(tasks)
            while left:
                u: ChoiceUpdate | None = await updates.get()
                if u is None:
                    left -= 1
                else:
                    yield u
        finally:
            for t in tasks:
                t.cancel()

    def interrupt_all(self, error: Exception) -> None:
        """The shutdown deadline: every choice still generating ends with `error`."""
        for c in list(self.live):
            c.interrupt(error)
