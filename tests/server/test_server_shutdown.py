"""`oasiskv serve` as a subprocess on a dummy-weight model (no tokenizer: token-id prompts, empty
texts, as on the GPU machine): `oasiskv bench serve` against it, then SIGTERM with two streams
open: the short one finishes within --shutdown-timeout, the long one is ended with an error
event and `data: [DONE]`. Last, a server whose engine faults exits with status 1.

The SIGTERM test stops the module's server, so it comes after the bench test.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from server_client import call, free_port, metrics, stream_events

from oasiskv.entrypoints.openai.server_process import start_server, stop_server, wait_for_health
from oasiskv.entrypoints.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.server]

FLAGS = ["--model", "smollm2-135m", "--load-format", "dummy", "--max-model-len", "2048",
         "--served-model-name", "tiny", "--shutdown-timeout", "8"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    proc = start_server(FLAGS, "127.0.0.1", port, timeout=300, stdout=log, stderr=log)
    yield proc, port, log_path
    stop_server(proc)
    log.close()


def test_bench_serve_reports_vllm_metrics(server, tmp_path, capsys):
    _, port, _ = server
    rc = main(["bench", "serve", "--port", str(port), "--num-prompts", "6", "--random-input-len", "12",
               "--random-output-len", "4", "--ignore-eos", "--max-concurrency", "4", "--request-rate", "50",
               "--result-dir", str(tmp_path), "--result-filename", "bench.json"])
    assert rc == 0
    printed = capsys.readouterr().out
    for label in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):", "Mean E2EL (ms):"):
        assert label in printed
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["completed"] == 6 and res["failed"] == 0 and res["model"] == "tiny"
    assert res["total_output_tokens"] == 24 and res["total_input_tokens"] == 72
    assert 0 < res["mean_ttft_ms"] <= res["mean_e2el_ms"] and res["mean_tpot_ms"] > 0


def test_sigterm_finishes_short_streams_and_ends_long_ones(server):
    proc, port, log_path = server
    base = f"http://127.0.0.1:{port}"
    short = {"model": "tiny", "prompt": [3, 1, 4, 1, 5], "max_tokens": 8, "ignore_eos": True}
    long = {"model": "tiny", "prompt": [2, 7, 1, 8], "max_tokens": 2000, "ignore_eos": True}  # minutes on CPU
    got: dict = {}
    clients = [threading.Thread(target=lambda k=k, b=b: got.update({k: stream_events(base, "/v1/completions", b)}))
               for k, b in (("short", short), ("long", long))]
    tokens_before = metrics(base)["oasiskv:generation_tokens_total"]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 60
    while metrics(base)["oasiskv:generation_tokens_total"] - tokens_before < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # until both streams are under way
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    time.sleep(0.5)
    try:  # no new request is admitted
        status = call(base, "/v1/completions", short, timeout=5)[0]
    except OSError:  # the listening socket is closed already
        status = None
    assert status in (None, 503)
    try:  # /health tells a load balancer the replica is draining
        health = urllib.request.urlopen(base + "/health", timeout=5).status
    except urllib.error.HTTPError as e:
        health = e.code
    except OSError:
        health = None
    assert health in (None, 503)
    for c in clients:
        c.join(60)
    assert time.monotonic() - sent < 20  # --shutdown-timeout 8, then the error events go out at once

    events = got["short"]
    assert events[-1] == "[DONE]" and len(events[:-1]) == 8, events[-2]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["text"] == "" for c in events[:-1])  # no tokenizer: ids only

    events = got["long"]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert "shutting down" in events[-2]["error"]["message"]
    assert 0 < len(events) - 2 < 2000  # some tokens, then the error

    assert stop_server(proc, timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM once drained
    assert "Application shutdown complete" in log_path.read_text()
    with pytest.raises(ProcessLookupError):  # nothing of its process group is left behind
        os.killpg(proc.pid, 0)


# `oasiskv serve` whose engine raises out of step() once a request starts with token 4343.
FAULTY_SERVE = """
import sys
from oasiskv.engine import llm_engine
step = llm_engine.LLMEngine.step
def faulty_step(self):
    if any(s.prompt_token_ids[:1] == [4343] for s in self.seqs.values()):
        raise RuntimeError("injected engine fault")
    return step(self)
llm_engine.LLMEngine.step = faulty_step
from oasiskv.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_engine_fault_exits_nonzero(tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    cmd = [sys.executable, "-c", FAULTY_SERVE, "serve", *FLAGS, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=log, stderr=log)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_health(base, 300, proc)
        status, got = call(base, "/v1/completions", {"prompt": [4343, 1, 2], "max_tokens": 4})
        assert status == 503 and "internal error" in got["error"]["message"]
        assert proc.wait(30) == 1
    finally:
        stop_server(proc)
        log.close()
    assert "injected engine fault" in (tmp_path / "server.log").read_text()  # the traceback is in the log
