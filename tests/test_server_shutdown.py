"""`oasiskv serve` as a subprocess on a dummy-weight model (no tokenizer: token-id prompts, empty
texts, as on the GPU machine): `oasiskv bench serve` against it, then SIGTERM in mid-stream.

The SIGTERM test stops the module's server, so it is the last test here.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from server_client import free_port, metrics, stream_events

from oasiskv.entrypoints.openai.server_process import start_server, stop_server
from oasiskv.entrypoints.cli import main

FLAGS = ["--model", "smollm2-135m", "--load-format", "dummy", "--max-model-len", "256",
         "--served-model-name", "tiny", "--shutdown-timeout", "60"]


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


def test_sigterm_lets_the_stream_finish_and_exits(server):
    proc, port, log_path = server
    base = f"http://127.0.0.1:{port}"
    body = {"model": "tiny", "prompt": [3, 1, 4, 1, 5], "max_tokens": 24, "ignore_eos": True}
    got: dict = {}
    tokens_before = metrics(base)["oasiskv:generation_tokens_total"]
    client = threading.Thread(target=lambda: got.update(events=stream_events(base, "/v1/completions", body)))
    client.start()
    deadline = time.monotonic() + 60
    while metrics(base)["oasiskv:generation_tokens_total"] == tokens_before and time.monotonic() < deadline:
        time.sleep(0.05)  # until the stream is under way
    produced = metrics(base)["oasiskv:generation_tokens_total"] - tokens_before
    proc.send_signal(signal.SIGTERM)
    assert 0 < produced < 24, "SIGTERM should land in mid-stream"
    client.join(120)
    events = got["events"]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 24 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["text"] == "" for c in chunks)  # no tokenizer: ids only
    assert stop_server(proc, timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM once drained
    assert "Application shutdown complete" in log_path.read_text()
    with pytest.raises(ProcessLookupError):  # nothing of its process group is left behind
        os.killpg(proc.pid, 0)
