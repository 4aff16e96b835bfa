"""The default model's real weights on the GPU: sparse decode through the batched pipeline on real
text, against the CPU pipeline (stages in order) and beside random weights of the same shapes.

    # here, on CPU: prompts (token ids of real text) and the CPU pipeline's greedy tokens
    python scripts/gpu_real_weights.py record --output scripts/real_weights_expected.json
    # on the GPU machine, with the GGUF staged by scripts/gpu_stage_model.sh
    PYTHONPATH=.:.gpu_site python3 scripts/gpu_real_weights.py check --gguf PATH \
        --expected scripts/real_weights_expected.json --output $OUT/real_weights.json

check runs three engines on the same prompts: real weights in float32 (tokens compared with the
recorded ones, step by step), real weights in bf16 and random (dummy) weights in bf16 (hit rate
and draft acceptance per request). Sparse settings are the accuracy tables' tight budget: K = 32,
1 sink + 4 window blocks of 16 tokens, threshold 1,024, `self` drafter, default fetch budget.
"""
from __future__ import annotations

import argparse
import json
import statistics

SPARSE = dict(sparse=True, top_k_blocks=32, sink_blocks=1, window_blocks=4, sparse_threshold=1024,
              drafter="self", host_kv_gb=1.0, max_model_len=8192)
TEXTS = [("code", 2000), ("prose", 2000), ("code", 3500), ("prose", 3500)]


def run(llm_kwargs: dict, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    from oasiskv.entrypoints.llm import LLM
    from oasiskv.sampling_params import SamplingParams

    llm = LLM(**llm_kwargs, **SPARSE)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return [{"tokens": list(o.token_ids), "hit_rate": o.stats.get("hit_rate"),
             "draft_acceptance": o.stats.get("draft_acceptance"), "sparse_steps": o.stats.get("sparse_steps")}
            for o in outs]


def record(a) -> None:
    from oasiskv.eval.texts import text_tokens
    from oasiskv.models.loader import resolve_model
    from oasiskv.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    prompts = [text_tokens(tok, name, n) for name, n in TEXTS]
    rows = run({"dtype": "float32"}, prompts, a.max_tokens)  # the pipeline on CPU, in order
    json.dump({"texts": TEXTS, "sparse": SPARSE, "max_tokens": a.max_tokens, "prompts": prompts,
               "cpu_inline_float32": rows}, open(a.output, "w"))
    for (name, n), r in zip(TEXTS, rows):
        print(f"{name} {n}: hit rate {r['hit_rate']:.3f}, draft acceptance {r['draft_acceptance']:.3f}")


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check(a) -> None:
    import torch

    exp = json.load(open(a.expected))
    prompts, n = exp["prompts"], exp["max_tokens"]
    result = {"device": torch.cuda.get_device_name(0), "texts": exp["texts"], "sparse": SPARSE, "runs": {}}
    runs = {"real float32": {"model": a.gguf, "dtype": "float32"},
            "real bf16": {"model": a.gguf, "dtype": "bfloat16"},
            "random bf16": {"model": a.gguf, "load_format": "dummy", "dtype": "bfloat16"}}
    for name, kwargs in runs.items():
        rows = run(kwargs, prompts, n)
        result["runs"][name] = rows
        print(f"{name}: hit rate {[round(r['hit_rate'], 3) for r in rows]}, draft acceptance "
              f"{[round(r['draft_acceptance'], 3) for r in rows]}", flush=True)
        json.dump(result, open(a.output, "w"), indent=1)  # what is done so far, if the call ends early
        torch.cuda.empty_cache()
    same = [first_difference(r["tokens"], e["tokens"])
            for r, e in zip(result["runs"]["real float32"], exp["cpu_inline_float32"])]
    result["float32_tokens_equal_to_cpu_before_first_difference"] = same
    json.dump(result, open(a.output, "w"), indent=1)
    print(f"| run | hit rate (mean) | draft acceptance (mean) |\n| --- | ---: | ---: |")
    cpu = exp["cpu_inline_float32"]
    print(f"| CPU, real float32 | {statistics.mean(r['hit_rate'] for r in cpu):.3f} | "
          f"{statistics.mean(r['draft_acceptance'] for r in cpu):.3f} |")
    for name, rows in result["runs"].items():
        print(f"| GPU pipeline, {name} | {statistics.mean(r['hit_rate'] for r in rows):.3f} | "
              f"{statistics.mean(r['draft_acceptance'] for r in rows):.3f} |")
    print(f"GPU float32 tokens equal to the CPU pipeline's before the first difference: {same} of {n}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--output", required=True)
    r.add_argument("--max-tokens", type=int, default=64)
    c = sub.add_parser("check")
    c.add_argument("--gguf", required=True)
    c.add_argument("--expected", required=True)
    c.add_argument("--output", required=True)
    a = ap.parse_args()
    record(a) if a.cmd == "record" else check(a)


if __name__ == "__main__":
    main()
