"""The server's periodic statistics line: throughput, what the engine holds, the decode step's
time and the sparse path's figures over the interval just ended."""
from __future__ import annotations

import pytest
import logging

from oasiskv import LLM, SamplingParams
from oasiskv.engine.stat_logger import StatLogger

pytestmark = pytest.mark.slow


def test_stat_line_counts_the_interval(caplog):
    llm = LLM(max_model_len=512, max_num_seqs=2, sparse=True, top_k_blocks=2, sink_blocks=1, window_blocks=2,
              sparse_threshold=200, host_kv_gb=0.05)
    stats = StatLogger(interval=3600)
    assert stats.maybe_log(llm.engine) is None  # the interval has not passed
    prompts = [[(7 * i + 3 * j) % 1000 + 10 for j in range(150)] for i in range(2)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    stats.interval = 0
    with caplog.at_level(logging.INFO, logger="oasiskv.stats"):
        line = stats.maybe_log(llm.engine)
    assert line in caplog.text
    assert "Running: 0 reqs (0 sparse)" in line and "Waiting: 0 reqs" in line
    assert "conversions: 2" in line and "sparse steps: " in line and "decode step: " in line
    assert "Prefix cache hit rate: 0.0%, host tier: 0.0%" in line  # different prompts: no hit in either tier
    steps = llm.engine.step_stats["decode_steps"]
    assert f" x {steps} (" in line
    again = stats.maybe_log(llm.engine)  # nothing ran since: zero throughput, no step figures
    assert "Avg generation throughput: 0.0 tokens/s" in again and "decode step" not in again
    totals = llm.engine.runner.sparse.totals  # two pipeline steps under a 200 MB budget, half used
    for key, value in (("steps", 2), ("foreground_s", 0.02), ("bytes", 2e8), ("budget_bytes", 4e8)):
        totals[key] += value
    assert "stall 0.0%, 100 of a 200 MB/step budget" in stats.maybe_log(llm.engine)
