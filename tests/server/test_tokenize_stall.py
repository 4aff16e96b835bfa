"""The open tokenizer routes cannot stall generation: two concurrent /tokenize calls of ~3.9 MB
each (under the body limit) run on a tokenizer and worker of their own, and a small completion
beside them is not queued behind them: it ends in under half their time, and within four times
its time alone (the calls and the suite's other worker share the two cores with it)."""
from __future__ import annotations

import argparse
import threading
import time

import pytest

from oasiskv.entrypoints.openai.server_process import start_server, stop_server
from server_client import call, free_port

pytestmark = [pytest.mark.slow, pytest.mark.server]


def timed_completion(base: str) -> float:
    t0 = time.perf_counter()
    status, out = call(base, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 2,
                                                 "temperature": 0}, timeout=120)
    assert status == 200, out
    return time.perf_counter() - t0


def test_huge_tokenize_calls_do_not_delay_a_completion():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(["--max-model-len", "1024", "--disable-log-stats"], "127.0.0.1", port)
    try:
        alone = min(timed_completion(base) for _ in range(3))
        text = open(argparse.__file__).read()
        huge = (text * (3_900_000 // len(text) + 1))[:3_900_000]
        results = []
        threads = [threading.Thread(target=lambda: results.append(call(base, "/tokenize", {"prompt": huge},
                                                                      timeout=600)[0])) for _ in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(1.0)  # the tokenizer routes are busy now
        beside = timed_completion(base)
        busy = any(t.is_alive() for t in threads)
        for t in threads:
            t.join()
        tokenize_s = time.perf_counter() - t0
        assert results == [200] * 2
        assert busy, "the tokenize calls ended before the completion ran: the test measured nothing"
        figures = f"{beside:.2f} s beside the tokenize calls ({tokenize_s:.2f} s), {alone:.2f} s alone"
        assert beside < 0.5 * tokenize_s and beside <= 4 * alone + 0.5, figures
    finally:
        stop_server(proc)
