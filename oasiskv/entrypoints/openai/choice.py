"""One choice of a response: one engine request, its outputs turned into text pieces on the
asyncio side (incremental detokenizing, stop strings), with its logprobs.

The engine gets token ids and no stop strings; when a stop string appears here the engine
request is aborted and tokens that came after it are dropped. Whatever ends the choice (its
last token, a stop string, an engine error for this request, the engine dying, the server's
shutdown deadline, the client leaving), the engine request is finished or aborted on the way out.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from oasiskv.disagg.decode_side import PREFILL_FAILED
from oasiskv.engine.async_engine import AsyncEngine, EngineStopped, RequestStream
from oasiskv.entrypoints.openai.detokenizer import IncrementalDetokenizer, StopStringText, TextOptions
from oasiskv.sampling_params import SamplingParams

log = logging.getLogger("oasiskv.server")


class ServerStopping(RuntimeError):
    """The shutdown deadline passed while this choice was still generating."""


@dataclass
class ChoiceUpdate:
    index: int
    text: str  # new text since the last update
    token_ids: list[int]  # new tokens since the last update
    logprobs: list[dict[int, float]] | None  # theirs, when asked
    finish_reason: str | None = None
    error: str | None = None  # set (with finish_reason "error") when this choice failed


class Choice:
    def __init__(self, engine: AsyncEngine, index: int, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, text: TextOptions, tokenizer, live: set):
        self.engine, self.index, self.request_id, self.live = engine, index, request_id, live
        self.prompt_ids, self.params = prompt_ids, params
        self.detok = IncrementalDetokenizer(tokenizer, text.skip_special_tokens)
        self.text = StopStringText(text.stop, text.include_stop_str_in_output)
        self.stream: RequestStream | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if getattr(params, "logprobs", None) is not None else None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0  # its prompt tokens found in the prefix cache
        self.error: str | None = None
        self.error_status = 500  # 503 when the engine or the server stopped
        self._sent = 0  # characters of text already in an update
        self._engine_tokens = 0  # engine tokens looked at

    async def start(self) -> None:
        self.stream = await self.engine.add_request(self.prompt_ids, self.params, self.request_id)
        self.live.add(self)

    def interrupt(self, error: Exception) -> None:
        """End the choice with `error` at its next await (on the event loop)."""
        if self.stream is not None and not self.stream.finished:
            self.stream.fail(error)

    @property
    def cumulative_logprob(self) -> float:
        return sum(d[t] for d, t in zip(self.logprobs or [], self.token_ids))

    async def updates(self):
        """Yields a ChoiceUpdate per engine output; the last one has finish_reason set."""
        try:
            async for out in self.stream:
                yield self._take(out)
                if self.finish_reason is not None:
                    return
        except (EngineStopped, ServerStopping) as e:
            yield self._fail(str(e), 503)
        except Exception:  # a bug here fails this choice only
            log.exception("request %s failed in the front end", self.request_id)
            yield self._fail("internal error while producing this choice")
        finally:
            self.live.discard(self)
            if self.stream is not None and not self.stream.finished:  # a stop string, or cut short
                self.engine.abort(self.request_id, "stop" if self.finish_reason == "stop" else "abort")

    async def run(self) -> "Choice":
        """Consume every update (non-streaming responses)."""
        async for _ in self.updates():
            pass
        return self

    def _fail(self, message: str, status: int = 500) -> ChoiceUpdate:
        self.finish_reason, self.error, self.error_status = "error", message, status
        return ChoiceUpdate(self.index, "", [], None, "error", message)

    def _take(self, out) -> ChoiceUpdate:
        if self.prompt_logprobs is None:
            self.prompt_logprobs = getattr(out, "prompt_logprobs", None)
        self.num_cached_tokens = getattr(out, "num_cached_tokens", None) or 0
        first_new = len(self.token_ids)
        new_ids = out.token_ids[self._engine_tokens:]
        engine_logprobs = getattr(out, "logprobs", None)
        for j, tok in enumerate(new_ids, start=self._engine_tokens):
            self.token_ids.append(tok)
            if self.logprobs is not None and engine_logprobs is not None:
                self.logprobs.append(engine_logprobs[j])
            if self.text.append(self.detok.add(tok)):
                break
        self._engine_tokens = len(out.token_ids)
        error = getattr(out, "error", None)
        if error and error.startswith(PREFILL_FAILED):  # a disaggregated request's prefill peer died
            log.warning("request %s failed: %s", self.request_id, error)
            return self._fail(error, 502)
        if error:  # the engine's text names an exception: it goes to the log, not to the client
            log.warning("request %s failed in the engine: %s", self.request_id, error)
            return self._fail("the request failed in the engine (an internal error in its sampling); "
                              "other requests are not affected")
        if self.text.stopped:
            self.finish_reason = "stop"
        elif out.finished:
            if self.text.append(self.detok.flush()):
                self.finish_reason = "stop"
            else:
                self.finish_reason = out.finish_reason or "stop"
        end = self.text.emittable(final=self.finish_reason is not None)
        piece, self._sent = self.text.text[self._sent:end], max(self._sent, end)
        logprobs = self.logprobs[first_new:] if self.logprobs is not None else None
        return ChoiceUpdate(self.index, piece, self.token_ids[first_new:], logprobs, self.finish_reason)
