"""The engine behind the server: `LLMEngine.step()` runs in its own thread, requests come and go
through queues, and each request's tokens stream back to the asyncio loop that asked for them.

Only the engine thread touches the engine. Requests arrive as token ids (the server tokenizes
on the asyncio side), so the thread spends its time on steps. The event loop sends commands
(add, abort, stop) through a thread-safe queue; the engine thread answers through
`loop.call_soon_threadsafe`, so nothing is shared but the two queues. Torch releases the GIL
inside its kernels, so HTTP handling goes on while a step runs.

A request whose own work failed in the engine comes back as an output with `error` set; only
an exception out of `step()` itself (a fault of the engine: the model, the device) stops the
thread. Then every request fails, `is_running` turns False and `on_death` is called.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from oasiskv.engine.llm_engine import LLMEngine, RequestOutput
from oasiskv.sampling_params import SamplingParams

log = logging.getLogger("oasiskv.engine")


class EngineStopped(RuntimeError):
    """The engine thread is gone (shutdown or a crash); the request cannot finish."""


class RequestStream:
    """One request's outputs on the asyncio side: `accepted` resolves (or raises the engine's
    ValueError) once the engine took the request; then iterate to get each new output."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.accepted: asyncio.Future = loop.create_future()
        self.finished = False
        self._outputs: asyncio.Queue = asyncio.Queue()

    # Called from the engine thread.
    def accept(self, error: Exception | None = None) -> None:
        self.loop.call_soon_threadsafe(self._settle, error)

    def put(self, item: RequestOutput | Exception) -> None:
        self.loop.call_soon_threadsafe(self._outputs.put_nowait, item)

    # Called on the event loop: the stream ends with `error` at its next read.
    def fail(self, error: Exception) -> None:
        self._outputs.put_nowait(error)

    def _settle(self, error: Exception | None) -> None:
        if self.accepted.done():
            return
        if error is None:
            self.accepted.set_result(None)
        else:
            self.accepted.set_exception(error)

    # Called on the event loop.
    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._outputs.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


@dataclass
class _Add:
    prompt: list[int]
    params: SamplingParams
    stream: RequestStream


@dataclass
class _Abort:
    request_id: str
    reason: str = "abort"  # "stop" when the front end ended it at a stop string


@dataclass
class _Call:
    fn: Callable[[LLMEngine], list[RequestOutput] | None]  # run on the engine thread


class _Stop:
    pass


class AsyncEngine:
    """`await engine.add_request(...)` -> RequestStream; `engine.abort(id)` frees it at once."""

    def __init__(self, engine: LLMEngine, metrics=None, on_death=None, stat_logger=None):
        self.engine = engine
        self.metrics = metrics  # ServerMetrics, told about every step and finished request
        self.stat_logger = stat_logger  # StatLogger: a line of statistics every few seconds
        self.on_death = on_death  # called (from the engine thread) once a fault has stopped it
        self.error: BaseException | None = None  # why the engine thread died, if it did
        self._last_output: dict[str, float] = {}  # request id -> when its last output left
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread = threading.Thread(target=self._run, name="oasiskv-engine", daemon=True)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()
        if self.metrics is not None:
            self.metrics.set_engine_alive(True)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop after the current step; requests still inside get EngineStopped."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout)

    async def add_request(self, prompt: list[int], params: SamplingParams,
                          request_id: str) -> RequestStream:
        if not self.is_running:
            raise EngineStopped("the engine is not running")
        stream = RequestStream(request_id, asyncio.get_running_loop())
        self._commands.put(_Add(prompt, params, stream))
        # The engine's ValueError (bad prompt, too long, ...) surfaces here. The engine thread
        # may die while the command waits: look now and then rather than hang.
        try:
            while not stream.accepted.done():
                await asyncio.wait([stream.accepted], timeout=1.0)
                if not stream.accepted.done() and not self.is_running:
                    raise EngineStopped("the engine stopped before taking the request")
        except asyncio.CancelledError:  # the caller gave up: do not leave the request running
            self.abort(request_id)
            raise
        stream.accepted.result()
        return stream

    def call_soon(self, fn: Callable[[LLMEngine], list[RequestOutput] | None]) -> None:
        """Run fn(engine) on the engine thread between steps, idle or not (safe from any thread);
        the outputs it returns go to their streams. An exception in it is logged, not fatal."""
        self._commands.put(_Call(fn))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Safe from any thread; a no-op for a request that already finished. `reason` is what
        the metrics count it as."""
        self._commands.put(_Abort(request_id, reason))

    # ---- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                # Idle: sleep until a command comes. Busy: take what has come, then step.
                block = not self.engine.has_unfinished()
                if not self._handle_commands(block):
                    break
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                if self.metrics is not None:
                    self.metrics.observe_engine(self.engine)
                if self.stat_logger is not None and not block:
                    self.stat_logger.maybe_log(self.engine)
        except BaseException as e:  # a fault of the engine: fail every request rather than hang them
            log.exception("engine thread died")
            self.error = e
        finally:
            self._fail_all(EngineStopped("the engine stopped after an internal error" if self.error
                                         else "the server is shutting down"))
            if self.metrics is not None:
                self.metrics.set_engine_alive(False)
            if self.error is not None and self.on_death is not None:
                self.on_death()

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once told to stop."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id, cmd.reason)
            elif isinstance(cmd, _Call):
                try:
                    outputs = cmd.fn(self.engine)
                except Exception:  # noqa: BLE001 - a helper's fault, not the engine's
                    log.exception("a call on the engine thread failed")
                    continue
                self._deliver(outputs or [])

    def _add(self, cmd: _Add) -> None:
        rid = cmd.stream.request_id
        try:
            self.engine.add_request(cmd.prompt, cmd.params, rid)
        except Exception as e:  # it checks before it changes anything: only this request fails
            cmd.stream.accept(e)
            return
        self._streams[rid] = cmd.stream
        cmd.stream.accept()

    def _abort(self, request_id: str, reason: str = "abort") -> None:
        if self._streams.pop(request_id, None) is None:
            return  # finished already (or never accepted)
        self._last_output.pop(request_id, None)
        self.engine.abort(request_id)  # frees its GPU pages and host extent now
        if self.metrics is not None:
            self.metrics.observe_abort(reason)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            last = self._last_output.get(out.request_id)
            if self.metrics is not None:  # before the client can see it: /metrics then counts what it saw
                self.metrics.observe_output(out, None if last is None else now - last)
            stream.put(out)
            self._last_output[out.request_id] = now
            if out.finished:
                del self._streams[out.request_id]
                del self._last_output[out.request_id]

    def _fail_all(self, error: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # the engine may be broken; the streams must still end
                pass
            stream.put(error)
        self._streams.clear()
        self._last_output.clear()
        # Requests handed in after the stop never reach the engine: refuse them too.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                cmd.stream.accept(error)
