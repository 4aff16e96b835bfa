"""lm-eval 0.4.13 drives the server as evaluations do: `local-completions`, the server's own
tokenizer (`tokenizer_backend=remote`: /tokenizer_info, /tokenize, /detokenize), token-id
prompts in batches of 4. On a tiny local multiple-choice task every per-choice loglikelihood
equals HF transformers' on the same tokens (1e-3); on a generate_until task every answer equals
HF's greedy continuation cut at the stop strings.
"""
from __future__ import annotations

import signal

import pytest
import torch
from lm_eval_client import evaluate
from server_client import free_port

from oasiskv.engine.llm_engine import RequestOutput
from oasiskv.entrypoints.openai.server_process import start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.server]



@pytest.fixture(scope="module")
def base(tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    proc = start_server(["--max-model-len", "512", "--log-level", "warning"], "127.0.0.1", port, timeout=300,
                        stdout=log, stderr=log)
    yield f"http://127.0.0.1:{port}"
    assert stop_server(proc) in (0, -signal.SIGTERM)
    log.close()


@pytest.fixture(scope="module")
def hf(hf_default):
    return hf_default


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of (context, continuation) into tokens (TemplateLM._encode_pair)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return whole[:len(ctx)], whole[len(ctx):]


@pytest.mark.skipif(not hasattr(RequestOutput, "prompt_logprobs"), reason="the engine does not return "
                    "prompt logprobs yet")
def test_lm_eval_loglikelihoods_equal_hf(base, hf, tmp_path):
    model, tok = hf
    samples = evaluate(base, tmp_path, "oasiskv_tiny_mc")
    assert len(samples) == 10
    worst, count = 0.0, 0
    for s in samples:
        doc = s["doc"]
        for choice, (got, _greedy) in zip(doc["choices"], s["filtered_resps"]):
            ctx, cont = _encode_pair(tok, doc["question"], " " + choice)
            ids = ctx + cont
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            want = sum(logp[i - 1, ids[i]].item() for i in range(len(ctx), len(ids)))
            worst, count = max(worst, abs(float(got) - want)), count + 1
    print(f"lm-eval vs HF transformers: {count} loglikelihoods, largest difference {worst:.1e}")
    assert worst < 1e-3, worst


def test_lm_eval_generate_until_equals_hf_greedy(base, hf, tmp_path):
    model, tok = hf
    samples = evaluate(base, tmp_path, "oasiskv_tiny_gen")
    assert len(samples) == 5
    for s in samples:
        ids = tok.encode(s["doc"]["question"], add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
        want = tok.decode(out, skip_special_tokens=True)
        for stop in ("\n", "Q:"):
            want = want.split(stop)[0]
        assert s["filtered_resps"][0] == want, (s["doc"], s["filtered_resps"])
