"""`oasiskv bench prefix`'s loads, driven by a fake engine (no model): the shared document is the
same in every request, and a multi-turn conversation's next turn re-sends the previous prompt
and answer and adds a new question, sent only once the previous turn has finished."""
from __future__ import annotations

import pytest
from types import SimpleNamespace

from oasiskv.bench.prefix import Load, compare


class FakeEngine:
    """Finishes one request per step (the oldest), answering with its prompt length mod 7."""

    def __init__(self):
        self.queue, self.prompts, self.n = [], {}, 0

    def add_request(self, prompt, params):
        rid = str(self.n)
        self.n += 1
        self.queue.append(rid)
        self.prompts[rid] = prompt
        return rid

    def has_unfinished(self):
        return bool(self.queue)

    def step(self):
        rid = self.queue.pop(0)
        n = len(self.prompts[rid])
        return [SimpleNamespace(request_id=rid, finished=True, token_ids=[n % 7, 1], metrics={"ttft": 0.5},
                                num_cached_tokens=0, num_host_cached_tokens=0)]


def args(**kw):
    base = dict(seed=0, num_requests=3, doc_len=20, question_len=4, conversations=2, turns=3, first_turn_len=10)
    return SimpleNamespace(**{**base, **kw})


def test_shared_doc_requests_share_the_document_only():
    load = Load("shared-doc", args(), vocab=50)
    assert len(load.first) == 3 and all(len(p) == 24 for p in load.first)
    assert all(p[:20] == load.first[0][:20] for p in load.first)
    assert len({tuple(p[20:]) for p in load.first}) == 3
    records = load.run(FakeEngine(), None)
    assert [r["turn"] for r in records] == [0, 0, 0]


def test_multi_turn_resends_the_history():
    load = Load("multi-turn", args(), vocab=50)
    eng = FakeEngine()
    records = load.run(eng, None)
    assert [(r["conversation"], r["turn"]) for r in records] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    by_turn = {(r["conversation"], r["turn"]): r for r in records}
    sent = list(eng.prompts.values())
    for c in range(2):
        prompt = load.first[c]
        for t in range(3):
            assert prompt in sent and by_turn[c, t]["prompt_len"] == len(prompt)
            if t < 2:
                prompt = prompt + by_turn[c, t]["token_ids"] + load.questions[c][t]
    assert [len(by_turn[0, t]["token_ids"]) for t in range(3)] == [2, 2, 2]


def test_compare_reports_against_the_cache_off_run():
    rec = lambda toks: {"token_ids": toks}  # noqa: E731
    off = {"load": "x", "cache": "off", "records": [rec([1]), rec([2])], "mean_ttft_ms": 100.0,
           "output_throughput": 10.0, "prefill_tokens_computed": 1000}
    on = {"load": "x", "cache": "on", "records": [rec([1]), rec([3])], "mean_ttft_ms": 20.0,
          "output_throughput": 12.0, "prefill_tokens_computed": 250}
    compare([off, on])
    assert on["tokens_equal_fraction"] == 0.5 and on["ttft_speedup"] == 5.0
    assert on["output_throughput_ratio"] == 1.2 and on["prefill_reduction"] == 0.75
    assert "ttft_speedup" not in off


@pytest.mark.slow
def test_control_run_changes_only_the_chunking(tmp_path):
    """The default model, dense: the control run (cache off, 16-token chunks) keeps the first
    cache-off run's greedy tokens and computes as many prefill tokens."""
    import argparse
    import json

    from oasiskv.bench.prefix import add_prefix_args, run_prefix_bench
    from oasiskv.entrypoints.args import add_engine_args

    p = argparse.ArgumentParser()
    add_prefix_args(p)
    add_engine_args(p)
    out = tmp_path / "prefix.json"
    a = p.parse_args(["--loads", "multi-turn", "--conversations", "2", "--turns", "2", "--first-turn-len", "40",
                      "--question-len", "8", "--output-len", "4", "--max-model-len", "256",
                      "--control-chunk", "16", "--output-json", str(out)])
    assert run_prefix_bench(a) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["cache"] for r in runs] == ["off", "on", "off, chunks of 16"]
    assert runs[2]["tokens_equal_fraction"] == 1.0
    assert runs[2]["prefill_tokens_computed"] == runs[0]["prefill_tokens_computed"]
