"""`oasiskv eval agreement` at tiny sizes on the real default model: well-formed output, and the
oracle (the true next token sent as the draft) predicts exactly the next step's top-K. The
decode crosses a block boundary (416), where a block leaves the window."""
import json

import pytest

from oasiskv.entrypoints.cli import main as cli_main


@pytest.mark.slow
def test_agreement_cli_small(tmp_path, capsys):
    out = tmp_path / "ag.json"
    assert cli_main(["eval", "agreement", "--texts", "code", "--context-len", "410", "--steps", "6",
                     "--ks", "2", "4", "--k", "4", "--drafters", "oracle", "prev",
                     "--sparse-threshold", "256", "--output-json", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    res = json.loads(out.read_text())
    assert printed["drafters"] == res["drafters"]
    assert set(res["drafters"]) == {"oracle", "prev"}
    for d in res["drafters"].values():
        assert len(d["per_layer"]) == 30 and all(0 <= v <= 1 for v in d["per_layer"])
        assert abs(d["mean"] - sum(d["per_layer"]) / 30) < 1e-9
    assert res["drafters"]["oracle"]["mean"] == 1.0  # in both modes, every layer
    for mode in ("greedy", "sampled"):  # the step log: the oracle's draft is always the real token
        o = res["by_draft"]["oracle"][mode]
        assert o["right"] == {"steps": 6, "agreement": 1.0} and o["wrong"]["steps"] == 0 and not o["wrong_at_steps"]
        assert [e["step"] for e in o["log"]] == list(range(6))
    for mode in ("greedy", "sampled"):
        assert res["by_mode"][mode]["agreement"]["oracle"]["2"]["min"] == 1.0
        cov = res["by_mode"][mode]["coverage"]
        for k in ("2", "4"):  # the best K blocks by true mass bound every selection of K
            assert all(q <= b + 1e-6 for q, b in zip(cov["quest"][k]["per_layer"], cov["best"][k]["per_layer"]))
            assert all(0 < b <= 1 + 1e-6 for b in cov["best"][k]["per_layer"])


def test_plot_written(tmp_path):
    from oasiskv.eval.agreement import plot_agreement
    layers = [0.5, 0.75, 1.0]
    cov = {"quest": {"4": {"per_layer": layers}}, "best": {"4": {"per_layer": layers}}}
    res = {"k": 4, "context_len": 400, "texts": ["code"], "pooled": {"coverage": cov},
           "drafters": {"self": {"mean": 0.75, "per_layer": layers}}}
    plot_agreement(res, str(tmp_path / "a.png"))
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
