"""`oasiskv eval fidelity` and `eval ablation` at tiny sizes on the real default model, and the
teacher-forcing logits processor they rest on."""
import json
import math

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.entrypoints.cli import main as cli_main
from oasiskv.eval.teacher_forcing import forced_logprobs

TINY = ["--texts", "code", "--context-len", "300", "--sparse-threshold", "256"]


@pytest.mark.slow
def test_teacher_forcing_emits_the_text_and_keeps_the_dense_distribution():
    llm = LLM(max_model_len=400)
    prompt = llm.tokenizer.encode("def add(a, b):\n    return", add_special_tokens=False)
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids
    forced = [11, 12, 13, 14]  # arbitrary, not what the model would say
    (lp,), _ = forced_logprobs(llm, [prompt], [forced])
    assert lp.shape == (4, llm.engine.runner.model_config.vocab_size)
    assert int(lp[0].argmax()) == free[0]  # step 0 is the model's own prediction after the prompt
    assert torch.allclose(lp.exp().sum(-1), torch.ones(4), atol=1e-4)


@pytest.mark.slow
def test_fidelity_cli_small(tmp_path, capsys):
    """fetch-all with K covering the context: sparse is exactly dense."""
    out = tmp_path / "fi.json"
    assert cli_main(["eval", "fidelity", *TINY, "--forced-tokens", "6", "--free-tokens", "4",
                     "--top-k-blocks", "32", "--fetch-all", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["steps"] == 5
    assert res["top1_agreement"] == 1.0 and res["kl_mean"] < 1e-6
    assert abs(res["ppl_ratio"] - 1) < 1e-4
    assert res["free_running_identical_tokens"] == [4]
    steps = res["per_step"]
    assert all(len(v) == 5 for v in steps.values()) and all(steps["top1_same"])
    assert abs(sum(steps["nll_dense"]) / 5 - math.log(res["ppl_dense"])) < 1e-4
    assert "top-1 agreement" in capsys.readouterr().out


@pytest.mark.slow
def test_ablation_cli_small(tmp_path):
    out, png = tmp_path / "ab.json", tmp_path / "ab.png"
    assert cli_main(["eval", "ablation", *TINY, "--forced-tokens", "4", "--passkey-context-len", "320",
                     "--depths", "0.5", "--seeds", "0", "--fetch-ratios", "0.05", "0.1", "--ks", "4",
                     "--base-k", "4", "--output-json", str(out), "--plot", str(png)]) == 0
    res = json.loads(out.read_text())
    # ceil(0.05 * 4) = ceil(0.1 * 4) = 1: one engine serves all three rows
    assert [(r["sweep"], r["top_k_blocks"], r["fetch_cap"]) for r in res["runs"]] == [
        ("fetch_ratio", 4, 1), ("fetch_ratio", 4, 1), ("k", 4, 1)]
    assert res["runs"][0]["ppl_sparse"] == res["runs"][2]["ppl_sparse"]
    for r in res["runs"]:
        assert r["passkey_total"] == 1 and r["steps"] == 3 and 0 <= r["top1_agreement"] <= 1
    assert png.read_bytes()[:4] == b"\x89PNG"
