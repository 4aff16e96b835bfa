"""A fault in one request's own work (its logits processor, its stop check) fails that request
alone: it ends with an error output, its pages and host extent go back, and the requests
batched with it finish with the tokens they have without it. A fault of the model itself
still stops the engine. Dense and sparse (the pipeline), on the real default model; the
sparse engine also returns logprobs, equal to dense ones with a full budget."""
import argparse

import pytest

import torch

from oasiskv import LLM, SamplingParams
from oasiskv.engine.sampler import sample_requests
from oasiskv.engine.sequence import Sequence

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


class FailsAt:
    """A logits processor that raises on its n-th call (1: the prefill's token)."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, row):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("injected fault")
        return row


def test_batched_sampling_fault_is_traced_to_its_row():
    """The batched stage raises (a setting broken after validation): each row alone finds the
    request at fault, the others sample what they sample without it, with the same noise."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seqs = [Sequence(str(i), [1], SamplingParams(temperature=0.9, top_k=5, seed=i)) for i in range(3)]
    for s in seqs:
        s.generator = torch.Generator().manual_seed(s.params.seed)
    want = sample_requests(logits, seqs)
    for s in seqs:
        s.generator.manual_seed(s.params.seed)
    seqs[1].params.top_k = "five"
    got = sample_requests(logits, seqs)
    assert seqs[1].error.startswith("sampling failed") and seqs[0].error is None and seqs[2].error is None
    assert got[0] == want[0] and got[2] == want[2]
    for s in seqs:
        s.params.top_k = "five"
    with pytest.raises(Exception):  # every row fails: not a request's fault
        sample_requests(logits, seqs)


@pytest.fixture(scope="module")
def dense():
    return LLM(max_model_len=1024)


@pytest.fixture(scope="module")
def sparse():
    # Sparse from the prompt's end; 16 blocks hold the whole context, so it decodes as dense does.
    return LLM(max_model_len=1024, sparse=True, sparse_threshold=96, top_k_blocks=16, host_kv_gb=0.25)


@pytest.fixture(scope="module")
def long_prompts(dense):
    ids = dense.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)
    return [ids[:130], ids[2000:2120], ids[5000:5140]]


def _assert_all_freed(llm):
    e = llm.engine
    assert not e.seqs and not e.scheduler.has_unfinished()
    assert e.block_manager.num_free == e.block_manager.num_pages
    if e.runner.sparse is not None:
        assert e.runner.sparse.host.bytes_used == 0


def _run_with_fault(llm, prompts, at: int, want):
    """want: the outputs of the same requests without the fault."""
    params = [SamplingParams(**GREEDY), SamplingParams(**GREEDY, logits_processors=[FailsAt(at)]),
              SamplingParams(**GREEDY)]
    got = llm.generate(prompts, params)
    bad = got[1]
    assert bad.finished and bad.finish_reason == "error" and "injected fault" in bad.error
    assert len(bad.token_ids) == at - 1  # the tokens before the failed one
    for i in (0, 2):
        assert got[i].error is None and got[i].token_ids == want[i].token_ids and got[i].finish_reason == "length"
    _assert_all_freed(llm)


@pytest.mark.slow
@pytest.mark.parametrize("at", [1, 4])
def test_dense_fault_fails_only_its_request(dense, at):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
    _run_with_fault(dense, prompts, at, dense.generate(prompts, SamplingParams(**GREEDY)))


@pytest.mark.slow
def test_sparse_fault_fails_only_its_request(dense, sparse, long_prompts):
    _run_with_fault(sparse, long_prompts, 4, dense.generate(long_prompts, SamplingParams(**GREEDY)))
    assert sparse.engine.runner.pipeline.num_rows == 0  # the pipeline ran it, and gave its rows back


@pytest.mark.slow
def test_sparse_returns_dense_logprobs_and_the_same_tokens(dense, sparse, long_prompts):
    ask = SamplingParams(**GREEDY, logprobs=3)
    plain = sparse.generate(long_prompts[0], SamplingParams(**GREEDY))
    got = sparse.generate(long_prompts[0], ask)
    ref = dense.generate(long_prompts[0], ask)
    for p, g, r in zip(plain, got, ref):
        assert g.stats["sparse_steps"] == 7
        assert g.token_ids == p.token_ids == r.token_ids and len(g.logprobs) == len(g.token_ids)
        for a, b in zip(g.logprobs, r.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-3 for t in a)


@pytest.mark.slow
def test_stop_check_fault_fails_only_its_request(dense):
    engine = dense.engine
    check = engine._finish_reason
    rids = [engine.add_request(p, SamplingParams(**GREEDY)) for p in ("The capital of France is", "Hello")]

    def failing(seq, tok):
        if seq.request_id == rids[1] and len(seq.output_token_ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return check(seq, tok)
    engine._finish_reason = failing
    try:
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
    finally:
        del engine._finish_reason
    assert done[rids[1]].finish_reason == "error" and "injected" in done[rids[1]].error
    assert done[rids[0]].error is None and len(done[rids[0]].token_ids) == 8
    _assert_all_freed(dense)


def test_model_fault_stops_the_engine(dense):
    """Not one request's fault: it leaves step() (the server then marks the engine dead)."""
    model = dense.engine.runner.model

    def broken(*args, **kwargs):
        raise RuntimeError("device fault")
    model.forward = broken
    try:
        dense.engine.add_request("hi", SamplingParams(**GREEDY))
        with pytest.raises(RuntimeError, match="device fault"):
            dense.engine.step()
    finally:
        del model.forward


@pytest.mark.slow
def test_detokenize_off_leaves_text_and_stop_strings_to_the_caller(dense):
    engine = dense.engine
    free = dense.generate("The capital of France is", SamplingParams(**GREEDY))[0]
    stop = free.text.split()[1]
    engine.detokenize = False
    try:
        out = dense.generate("The capital of France is", SamplingParams(**GREEDY, stop=[stop],
                                                                       stop_token_ids=[free.token_ids[5]]))[0]
    finally:
        engine.detokenize = True
    assert out.text == "" and out.finish_reason == "stop"  # the stop token, not the earlier stop string
    assert out.token_ids == free.token_ids[:6]
