"""lm-eval 0.4.13's `local-completions` against a server: the tiny local tasks of
tests/lm_eval_tasks, the server's own tokenizer (`tokenizer_backend=remote`), batches of 4."""
from __future__ import annotations

import os

TASKS = os.path.join(os.path.dirname(__file__), "lm_eval_tasks")
MODEL = "SmolLM2-135M-Instruct"


def tasks_here(tmp_path) -> str:
    """The task yamls with their data files as absolute paths (lm-eval reads them relative to the cwd)."""
    for name in os.listdir(TASKS):
        text = open(os.path.join(TASKS, name)).read()
        if name.endswith(".yaml"):
            text = text.replace("tests/lm_eval_tasks/", TASKS + "/")
        (tmp_path / name).write_text(text)
    return str(tmp_path)


def evaluate(base: str, tmp_path, task: str, api_key: str | None = None) -> list[dict]:
    """The task's samples (lm-eval's log of each request and its filtered answer)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=dict(base_url=base + "/v1/completions", model=MODEL, tokenizer_backend="remote",
                        tokenized_requests=True, max_length=512, max_retries=1,
                        **({"header": {"Authorization": f"Bearer {api_key}"}} if api_key else {})),
        tasks=[task], batch_size=4, log_samples=True, task_manager=TaskManager(include_path=tasks_here(tmp_path)))
    return out["samples"][task]
