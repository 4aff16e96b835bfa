"""Triton kernels compiled while serving, logged with the time they took.

A compilation runs on the engine loop, so every request waits for it; whatever the start-up's
warm-up did not build shows up here (a request's first conversion, a new launch shape).
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


class RuntimeCompiles:
    """Counts and logs each Triton compilation from `install()` on."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self._started = threading.local()
        self._before_prev = self._after_prev = None

    def install(self) -> bool:
        """Hook Triton's JIT (keeping any hooks already set); False where Triton has no hooks."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_cache_hook"):
            return False
        self._before_prev, self._after_prev = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        return True

    def _before(self, **kw):
        self._started.t0 = time.perf_counter()
        # A true answer would skip the compilation: pass on only what an earlier hook says.
        return self._before_prev(**kw) if self._before_prev else None

    def _after(self, **kw):
        seconds = time.perf_counter() - getattr(self._started, "t0", time.perf_counter())
        self.count += 1
        self.seconds += seconds
        fn = kw.get("fn")
        name = f"{fn.module}.{fn.name}" if fn is not None else "a kernel"
        log.info("Triton compiled %s while serving (%.2f s; %d so far): the warm-up did not build it",
                 name, seconds, self.count)
        return self._after_prev(**kw) if self._after_prev else None


_WATCHER: RuntimeCompiles | None = None


def watch() -> RuntimeCompiles | None:
    """The process's one watcher, installed on first call (engines built later share it);
    None where Triton has no hooks."""
    global _WATCHER
    if _WATCHER is None:
        watcher = RuntimeCompiles()
        if not watcher.install():
            return None
        _WATCHER = watcher
    return _WATCHER
