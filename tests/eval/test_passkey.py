"""Passkey retrieval at ~4K tokens on the real default model: sparse (K=32 blocks, window 4,
sink 1, threshold 1024, `self` drafter) retrieves as many keys as dense. A few cases here;
`oasiskv eval passkey` runs more (docs/accuracy.md)."""
import json
import re

import pytest

from oasiskv import LLM
from oasiskv.entrypoints.cli import main as cli_main
from oasiskv.eval.passkey import is_right, make_cases, score

SPARSE = dict(sparse=True, top_k_blocks=32, window_blocks=4, sink_blocks=1, sparse_threshold=1024,
              drafter="self", host_kv_gb=1.0)


@pytest.mark.slow
def test_sparse_retrieves_as_many_keys_as_dense():
    """Two cases sparse decode used to lose (docs/accuracy.md), one for each cause: seed 0 at
    depth 0.3 to the scoring (the summed Quest bound), seed 2 at depth 0.5 to the fetch cap. The
    model finds both with dense decode; sparse must find them too."""
    sparse = LLM(max_model_len=4100, **SPARSE)
    cases = (make_cases(sparse.tokenizer, 4000, depths=[0.3], seeds=[0])
             + make_cases(sparse.tokenizer, 4000, depths=[0.5], seeds=[2]))
    assert score(sparse, cases) == [True] * len(cases)


@pytest.mark.slow
def test_passkey_cli_small(tmp_path, capsys):
    out = tmp_path / "pk.json"
    assert cli_main(["eval", "passkey", "--context-len", "600", "--depths", "0.5", "--seeds", "0",
                     "--drafters", "self", "oracle", "--sparse-threshold", "256", "--top-k-blocks", "4",
                     "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"dense", "self", "oracle"}
    assert all(r["total"] == 1 for r in res["runs"].values())
    assert "| all |" in capsys.readouterr().out


def test_fresh_set_is_fixed_and_scored_on_the_exact_number():
    """The fresh set: at least 30 prompts over several fillers, depths and seeds, built the
    same every time, none at the suite's depths; exact scoring rejects what a substring takes."""
    from oasiskv.eval.passkey import case_name, is_right, make_fresh_cases, run_config
    from oasiskv.models.loader import resolve_model
    from oasiskv.models.tokenizer import load_tokenizer
    from oasiskv.config import EngineConfig

    tok = load_tokenizer(resolve_model(None))
    cases = make_fresh_cases(tok, 3900)
    again = make_fresh_cases(tok, 3900)
    assert len(cases) >= 30
    assert [(c.key, c.token_ids) for c in cases] == [(c.key, c.token_ids) for c in again]
    assert len({c.filler for c in cases}) >= 3 and len({c.depth for c in cases}) >= 3
    assert len({c.seed for c in cases}) >= 2 and len({c.key for c in cases}) >= 6
    assert not {c.depth for c in cases} & {0.1, 0.3, 0.5, 0.7, 0.9}
    assert all(len(c.token_ids) == 3900 for c in cases)
    assert len({case_name(c) for c in cases}) == len(cases)  # what --cases picks them by
    for c in cases[:3]:
        assert f"The pass key is {c.key}." in tok.decode(c.token_ids)
    other = make_fresh_cases(tok, 2000, fillers=("textwrap",), depths=(0.5,), seeds=(7, 8))
    assert [(c.filler, c.depth, c.seed) for c in other] == [("textwrap", 0.5, 7), ("textwrap", 0.5, 8)]
    assert other[0].key != other[1].key and all(len(c.token_ids) == 2000 for c in other)

    key = "12345"
    assert is_right(" 12345. Remember", key, exact=True)
    assert is_right(" **12345**", key, exact=True)
    for wrong in (" 123456.", " 012345", " 1234", " 77726 or 12345", " none"):
        assert not is_right(wrong, key, exact=True)
    assert is_right(" 123456.", key, exact=False)  # the suite's substring scoring would take it

    base = EngineConfig.from_flat(top_k_blocks=32, fetch_ratio=0.05)
    assert run_config(base, "dense").sparse.enabled is False
    sc = run_config(base, "oracle:fetch_ratio=0.02,top_k_blocks=64").sparse
    assert (sc.enabled, sc.drafter, sc.fetch_ratio, sc.top_k_blocks) == (True, "oracle", 0.02, 64)


def test_multikey_prompt_names_every_key_once_and_asks_for_one():
    """--keys 4: four named keys with distinct numbers, each stated once, the asked one at the
    case's depth; the question names it; a distractor's key scores wrong."""
    from oasiskv.eval.passkey import make_case
    from oasiskv.models.loader import resolve_model
    from oasiskv.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    for depth, seed in ((0.1, 0), (0.9, 5)):
        c = make_case(tok, 1500, depth, seed, keys=4)
        assert make_case(tok, 1500, depth, seed, keys=4).token_ids == c.token_ids  # fixed
        text = tok.decode(c.token_ids)
        assert len(c.token_ids) == 1500 and len({c.key, *c.distractors}) == 4
        for key in (c.key, *c.distractors):
            assert text.count(f" is {key}. Remember it. {key} is the pass key of the ") == 1
        asked = re.search(rf"The pass key of the (\w+) is {c.key}\.", text).group(1)
        assert text.endswith(f"What is the pass key of the {asked}? The pass key of the {asked} is")
        position = text.index(c.key) / len(text)
        assert abs(position - depth) < 0.1
        assert not is_right(f" {c.distractors[0]}.", c.key, exact=True)
    assert make_case(tok, 1500, 0.5, 0).distractors == ()  # one key: the suite's prompt


@pytest.mark.slow
def test_passkey_cli_multikey(tmp_path):
    out = tmp_path / "pk.json"
    assert cli_main(["eval", "passkey", "--context-len", "600", "--keys", "3", "--depths", "0.5", "--seeds", "0",
                     "--drafters", "self", "--sparse-threshold", "256", "--top-k-blocks", "4",
                     "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["keys"], res["scoring"]) == (3, "exact number")
    assert all(len(c["distractors"]) == 2 for r in res["runs"].values() for c in r["per_case"])
