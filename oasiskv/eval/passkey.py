"""RULER-style passkey retrieval: a number hidden at a chosen depth of filler text.

`oasiskv eval passkey` runs dense and sparse (at given budgets and drafters) on the same
prompts and prints an accuracy table; `--json` / `--output-json` give the raw results.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
QUESTION = "What is the pass key? The pass key is"


@dataclass
class PasskeyCase:
    seed: int
    depth: float  # 0 = start of the filler, 1 = end
    key: str
    token_ids: list[int]


def make_case(tokenizer, context_tokens: int, depth: float, seed: int) -> PasskeyCase:
    """A prompt of about `context_tokens` tokens with the key at `depth` of the filler."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    head = ("There is an important piece of information hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about it.\n")
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)
    fixed = len(enc(head)) + len(enc(needle)) + len(enc("\n" + QUESTION))
    filler_ids = enc(FILLER)
    n_filler = max(0, context_tokens - fixed)
    filler = (filler_ids * (n_filler // len(filler_ids) + 1))[:n_filler]
    cut = int(len(filler) * depth)
    ids = enc(head) + filler[:cut] + enc(needle) + filler[cut:] + enc("\n" + QUESTION)
    return PasskeyCase(seed, depth, key, ids)


def make_cases(tokenizer, context_tokens: int, depths: list[float], seeds: list[int]) -> list[PasskeyCase]:
    return [make_case(tokenizer, context_tokens, d, s) for d in depths for s in seeds]


def score(llm, cases: list[PasskeyCase], max_tokens: int = 8) -> list[bool]:
    """Greedy answers, all cases in one batch; right when the key's digits come out."""
    from oasiskv.sampling_params import SamplingParams

    outs = llm.generate([c.token_ids for c in cases], SamplingParams(temperature=0, max_tokens=max_tokens),
                        use_tqdm=False)
    return [c.key in o.text for c, o in zip(cases, outs)]


def add_passkey_args(p) -> None:
    p.add_argument("--context-len", type=int, default=4000, help="prompt tokens")
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--drafters", nargs="+", default=["self"], help="sparse drafters to compare with dense")
    p.add_argument("--output-json", default=None)


def run_passkey(args) -> int:
    """Dense, then each sparse drafter (the engine's sparse flags set K, window, cap, ...)."""
    import json
    from dataclasses import replace

    from oasiskv.entrypoints.args import engine_config
    from oasiskv.entrypoints.llm import LLM

    base = engine_config(args)
    if base.max_model_len is None:
        base = replace(base, max_model_len=args.context_len + 64)
    results = {"context_len": args.context_len, "depths": args.depths, "seeds": args.seeds,
               "sparse": {"top_k_blocks": base.top_k_blocks, "sink_blocks": base.sink_blocks,
                          "window_blocks": base.window_blocks, "fetch_ratio": base.fetch_ratio,
                          "sparse_threshold": base.sparse_threshold, "summary_dtype": base.summary_dtype},
               "runs": {}}
    cases = None
    for name in ["dense"] + list(args.drafters):
        cfg = replace(base, sparse=False) if name == "dense" else replace(base, sparse=True, drafter=name)
        llm = LLM.from_config(cfg)
        cases = cases or make_cases(llm.tokenizer, args.context_len, args.depths, args.seeds)
        right = score(llm, cases)
        results["runs"][name] = {"correct": sum(right), "total": len(right), "per_case": [
            {"depth": c.depth, "seed": c.seed, "ok": ok} for c, ok in zip(cases, right)]}
        print(f"{name:>8}: {sum(right)}/{len(right)}", flush=True)
    print_passkey_table(results)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def print_passkey_table(results: dict) -> None:
    runs = results["runs"]
    print(f"\npasskey retrieval, {results['context_len']} tokens; sparse: {results['sparse']}")
    print("| depth | " + " | ".join(runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for d in results["depths"]:
        cells = []
        for r in runs.values():
            oks = [c["ok"] for c in r["per_case"] if c["depth"] == d]
            cells.append(f"{sum(oks)}/{len(oks)}")
        print(f"| {d:.2f} | " + " | ".join(cells) + " |")
    print("| all | " + " | ".join(f"{r['correct']}/{r['total']}" for r in runs.values()) + " |")
