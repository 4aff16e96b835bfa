"""Bad input gets a clear error naming the problem, and the engine keeps serving."""
import pytest

from oasiskv import LLM, SamplingParams
from oasiskv.entrypoints.cli import main as cli_main

pytestmark = [pytest.mark.slow, pytest.mark.server]

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256)


@pytest.mark.parametrize("kwargs, words", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_sampling_params(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("model, words", [
    ("/no/such/model/dir", "/no/such/model/dir"),
    ("not-a-preset-xyz", "not-a-preset-xyz"),
])
def test_unknown_model(model, words):
    with pytest.raises(ValueError, match=words):
        LLM(model=model)


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="max_num_seq\\b|max_num_seq"):
        LLM(max_num_seq=3)


def test_bad_prompts_leave_other_requests_running(llm):
    engine = llm.engine
    good = engine.add_request("The capital of France is", GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("", GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="maximum model length 256"):
        engine.add_request(list(range(100, 400)), GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([5, 10**9], GREEDY)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(done) == [good] and len(done[good].token_ids) == 8
    # and a request after the failures is served normally
    assert llm.generate("The capital of France is", GREEDY)[0].token_ids == done[good].token_ids


def test_generate_list_with_one_bad_prompt_adds_nothing(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["Hello there", ""], GREEDY)
    assert not llm.engine.has_unfinished()


def test_cli_reports_errors_cleanly(capsys):
    assert cli_main(["generate", "--prompt", "hi", "--model", "nope-preset"]) == 2
    assert "nope-preset" in capsys.readouterr().err
    assert cli_main(["generate", "--prompt", "hi", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
