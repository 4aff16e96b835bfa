"""`oasiskv eval reasoning` at tiny sizes on the default model: with every block held and no cap
the sparse free run is token for token dense."""
import json

import pytest

from oasiskv.entrypoints.cli import main as cli_main
from oasiskv.eval.reasoning import first_difference, parse_answer
from oasiskv.eval.reasoning_problems import EASY_PROBLEMS, LONG_PROBLEMS, PROBLEMS, collatz_steps, recurrence


def test_problems_have_their_worked_answers():
    assert len(PROBLEMS) >= 20 and len({p.name for p in PROBLEMS}) == len(PROBLEMS)
    assert collatz_steps(6) == 8  # 6 3 10 5 16 8 4 2 1
    # a = 3 -> 0 2 12 11 6 15 9 13 16 14 4 5 (12 times (5a + 2) mod 17)
    assert recurrence(3, 5, 2, 17, 12).answer == 5
    answers = {p.name: p.answer for p in PROBLEMS}
    assert answers["nested-loops"] == sum(i * j % 7 for i in range(1, 6) for j in range(i, 6))
    assert all(p.prompt.endswith("`Answer: N`, N the number.") for p in PROBLEMS)


def test_easy_set_answers():
    answers = {p.name: p.answer for p in EASY_PROBLEMS}
    assert len(answers) == len(EASY_PROBLEMS) == 12
    assert answers["eggs"] == 37 and answers["sum-range"] == 10 and answers["if-else"] == 15


def test_long_set_answers():
    answers = {p.name: p.answer for p in LONG_PROBLEMS}
    assert len(answers) == len(LONG_PROBLEMS) == 6
    assert answers["table-7x250"] == 1750 and answers["running-sum-150"] == 11325
    assert answers["countdown-3000-by-5"] == 5 and answers["countdown-2000-by-7"] == 5  # 2000 = 7 * 285 + 5


def test_answer_and_first_difference():
    assert parse_answer("so 17.\nAnswer: 42\nAnswer: 7") == 42
    assert parse_answer("Answer: **-3**") == -3
    assert parse_answer("Answer: \\(\\boxed{37}\\)") == 37
    assert parse_answer("so 42 - 5 = 37, the total is \\(\\boxed{37}\\). 1 more") == 37
    assert parse_answer("42 - 5 = 37. The answer is `N`.") == 37
    assert parse_answer("no number at all") is None
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2


@pytest.mark.slow
def test_reasoning_cli_full_budget_is_dense(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli_main(["eval", "reasoning", "--problems", "1", "--max-tokens", "24", "--sparse-threshold", "96",
                     "--drafters", "self:top_k_blocks=64,fetch_ratio=1.0",
                     "--output-json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    dense, full = (runs[k]["per_problem"][0] for k in runs)
    assert dense["prompt_tokens"] > 96 and dense["generated_tokens"] > 8  # converts after the prefill
    assert dense["sparse_steps"] == 0 and full["sparse_steps"] == full["generated_tokens"] - 1
    assert full["identical_to_dense"] == full["generated_tokens"] == dense["generated_tokens"]
    assert full["text"] == dense["text"]
    assert "| self:top_k_blocks=64,fetch_ratio=1.0 |" in capsys.readouterr().out
