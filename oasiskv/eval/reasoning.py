"""Reasoning-shaped free runs: a short prompt, a long greedy worked answer that crosses the
sparse threshold, dense against sparse.

`oasiskv eval reasoning` runs the problems of `reasoning_problems.py` through the chat template,
greedy, to EOS or `--max-tokens`, once dense and once per sparse run (as `eval passkey`'s
`--drafters`). Per problem: the tokens identical to dense before the first difference, the
steps decoded sparse (a request converts once its context passes `--sparse-threshold`), and
whether its `Answer: N` is right. With a short prompt only the generated tokens can cross the
threshold, so every sparse step reads a context the model wrote itself.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, replace

ANSWER = re.compile(r"Answer:\s*\**\s*(?:\\\(\s*)?(?:\\boxed\{)?(-?\d+)")
BOXED = re.compile(r"\\boxed\{(-?\d+)\}")
NUMBER = re.compile(r"-?\d+")


def add_reasoning_args(p) -> None:
    p.add_argument("--max-tokens", type=int, default=2048, help="generated tokens at most per problem")
    p.add_argument("--set", dest="problem_set", choices=("hard", "easy", "long"), default="hard",
                   help="the problem set (reasoning_problems.py): hard; easy, where a small model gets some "
                        "right; long, 2K-4K tokens of simple steps")
    p.add_argument("--problems", type=int, default=None, help="the first N problems only (default: all)")
    p.add_argument("--drafters", nargs="+", default=["self"],
                   help="sparse runs to compare with dense: DRAFTER[:FIELD=VALUE,...] (as eval passkey)")
    p.add_argument("--output-json", default=None)


def parse_answer(text: str) -> int | None:
    """The number after the first `Answer:`; without one (small models often end otherwise), the
    last `\\boxed{N}`, else the last number of the text; None if there is none."""
    m = ANSWER.search(text)
    if m:
        return int(m.group(1))
    for pattern in (BOXED, NUMBER):
        found = pattern.findall(text)
        if found:
            return int(found[-1])
    return None


def first_difference(a: list[int], b: list[int]) -> int:
    """Tokens identical before the first difference (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_problems(llm, problems, max_tokens: int) -> list[dict]:
    from oasiskv.sampling_params import SamplingParams

    prompts = [llm.apply_chat_template([{"role": "user", "content": p.prompt}]) for p in problems]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [{"name": p.name, "prompt_tokens": len(o.prompt_token_ids), "generated_tokens": len(o.token_ids),
             "token_ids": o.token_ids, "text": o.text, "answer": parse_answer(o.text),
             "right": parse_answer(o.text) == p.answer, "sparse_steps": o.stats.get("sparse_steps", 0)}
            for p, o in zip(problems, outs)]


def run_reasoning(args) -> int:
    from oasiskv.entrypoints.args import engine_config
    from oasiskv.entrypoints.llm import LLM
    from oasiskv.eval.passkey import run_config
    from oasiskv.eval.reasoning_problems import SETS

    problems = SETS[args.problem_set][:args.problems] if args.problems else SETS[args.problem_set]
    base = engine_config(args)
    base = replace(base, max_model_len=base.max_model_len or args.max_tokens + 512)
    results = {"set": args.problem_set, "max_tokens": args.max_tokens, "problems": [asdict(p) for p in problems], "runs": {}}
    dense = None
    for spec in ["dense"] + list(args.drafters):
        cfg = run_config(base, spec)
        llm = LLM.from_config(cfg)
        rows = run_problems(llm, problems, args.max_tokens)
        del llm
        dense = dense or [r["token_ids"] for r in rows]
        for r, d in zip(rows, dense):
            r["identical_to_dense"] = first_difference(r.pop("token_ids"), d)
        results["runs"][spec] = {
            "config": {"sparse": cfg.sparse.enabled} | {k: v for k, v in asdict(cfg.sparse).items() if k in (
                "drafter", "top_k_blocks", "sink_blocks", "window_blocks", "fetch_ratio",
                "sparse_threshold", "fetch_budget", "summary_dtype")},
            "right": sum(r["right"] for r in rows), "total": len(rows), "per_problem": rows}
        print(f"{spec:>8}: {sum(r['right'] for r in rows)}/{len(rows)} right, "
              f"{sum(r['sparse_steps'] for r in rows)} sparse steps", flush=True)
        if args.output_json:  # after every run, so a long evaluation keeps what it measured
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=1)
    print_reasoning_table(results)
    return 0


def print_reasoning_table(results: dict) -> None:
    runs = results["runs"]
    print(f"\nreasoning free runs: {len(results['problems'])} problems, greedy, at most "
          f"{results['max_tokens']} tokens")
    print("| run | right | sparse steps | generated tokens | identical to dense before the first difference "
          "(median) | problems identical to the end | answers as dense |")
    print("|---|---|---|---|---|---|---|")
    dense = runs["dense"]["per_problem"]
    for spec, run in runs.items():
        rows = run["per_problem"]
        same = sorted(r["identical_to_dense"] for r in rows)
        whole = sum(r["identical_to_dense"] == r["generated_tokens"] == d["generated_tokens"]
                    for r, d in zip(rows, dense))
        agree = sum(r["answer"] == d["answer"] for r, d in zip(rows, dense))
        print(f"| {spec} | {run['right']}/{run['total']} | {sum(r['sparse_steps'] for r in rows)} "
              f"| {sum(r['generated_tokens'] for r in rows)} | {sum(same)} ({same[len(same) // 2]}) "
              f"| {whole}/{len(rows)} | {agree}/{len(rows)} |")
