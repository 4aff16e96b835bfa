"""RULER-style passkey retrieval: a number hidden at a chosen depth of filler text.

`oasiskv eval passkey` runs dense and sparse runs (drafters, each with optional engine
overrides) on the same prompts and prints an accuracy table; `--output-json` keeps the raw
results. Two prompt sets:
- `suite`: the repeated "grass is green" filler at the given depths and seeds; an answer is
  right when the key's digits appear in it (the set of docs/accuracy.md's 25/25 table).
- `fresh`: 30 prompts on real text that ships with Python (three standard library modules'
  source x five depths x two seeds, none of them the suite's); an answer is right only when
  its first number equals the key.
`--keys N` (either set) hides N keys with different names, as RULER's multi-key needle task:
the asked key at the case's depth, the others at random depths; the question names one key,
and an answer is right only when its first number is that key (a distractor's key is wrong).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
QUESTION = "What is the pass key? The pass key is"
# Source code, not prose: on English prose about Python (the language reference, its license)
# the default model answers "a special key that ..." even dense.
FRESH_FILLERS = ("argparse", "shutil", "calendar")
FRESH_DEPTHS = (0.05, 0.25, 0.45, 0.65, 0.85)
FRESH_SEEDS = (10, 11)
SUITE_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
SUITE_SEEDS = (0, 1, 2, 3)
# Names of the keys of a multi-key prompt: no word of the suite's filler, one token or two each.
KEY_NAMES = ("fox", "owl", "whale", "tiger", "heron", "bison", "lynx", "gecko")


@dataclass
class PasskeyCase:
    seed: int
    depth: float  # 0 = start of the filler, 1 = end
    key: str
    token_ids: list[int]
    filler: str = "grass"
    distractors: tuple[str, ...] = ()  # the other keys of a multi-key prompt


def make_case(tokenizer, context_tokens: int, depth: float, seed: int,
              filler: str = "grass", filler_ids: list[int] | None = None, keys: int = 1) -> PasskeyCase:
    """A prompt of about `context_tokens` tokens with the key at `depth` of the filler. The
    filler is `filler_ids` from its start (repeated if short), else the suite's sentence.
    keys > 1: as many named keys, the others at random depths; the question asks for the first."""
    rng = random.Random(seed if filler == "grass" else f"{filler}:{seed}")
    key = str(rng.randint(10000, 99999))
    if keys == 1:
        needles = [(depth, f" The pass key is {key}. Remember it. {key} is the pass key. ")]
        question, distractors = QUESTION, ()
    else:
        if not 1 < keys <= len(KEY_NAMES):
            raise ValueError(f"--keys takes 1 to {len(KEY_NAMES)}, not {keys}")
        names = rng.sample(KEY_NAMES, keys)
        values = [key]
        while len(values) < keys:
            v = str(rng.randint(10000, 99999))
            values += [v] if v not in values else []
        depths = [depth] + [rng.random() for _ in names[1:]]
        needles = [(d, f" The pass key of the {n} is {v}. Remember it. {v} is the pass key of the {n}. ")
                   for d, n, v in zip(depths, names, values)]
        question, distractors = f"What is the pass key of the {names[0]}? The pass key of the {names[0]} is", \
            tuple(values[1:])
    head = ("There is an important piece of information hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about it.\n")
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)
    needle_ids = [(d, enc(n)) for d, n in needles]
    fixed = len(enc(head)) + sum(len(n) for _, n in needle_ids) + len(enc("\n" + question))
    filler_ids = filler_ids or enc(FILLER)
    n_filler = max(0, context_tokens - fixed)
    filler_ids = (filler_ids * (n_filler // len(filler_ids) + 1))[:n_filler]
    ids, done = enc(head), 0
    for d, n in sorted(needle_ids, key=lambda x: x[0]):
        cut = int(len(filler_ids) * d)
        ids += filler_ids[done:cut] + n
        done = cut
    ids += filler_ids[done:] + enc("\n" + question)
    return PasskeyCase(seed, depth, key, ids, filler, distractors)


def make_cases(tokenizer, context_tokens: int, depths: list[float], seeds: list[int],
               keys: int = 1) -> list[PasskeyCase]:
    return [make_case(tokenizer, context_tokens, d, s, keys=keys) for d in depths for s in seeds]


def make_fresh_cases(tokenizer, context_tokens: int, keys: int = 1, fillers=FRESH_FILLERS,
                     depths=FRESH_DEPTHS, seeds=FRESH_SEEDS) -> list[PasskeyCase]:
    """Each filler text (a standard library module's source) x depth x seed; the key depends on
    the filler and the seed. The defaults are the 30 prompts of the fresh set."""
    from oasiskv.eval.texts import module_source

    cases = []
    for name in fillers:
        ids = tokenizer.encode(module_source(name), add_special_tokens=False)
        cases += [make_case(tokenizer, context_tokens, d, s, name, ids, keys) for d in depths for s in seeds]
    return cases


def case_name(c: PasskeyCase) -> str:
    return f"{c.filler}:{c.depth:g}:{c.seed}"


def answer_number(text: str) -> str | None:
    """The first number in an answer, as its whole run of digits, or None."""
    m = re.search(r"\d+", text)
    return m.group() if m else None


def is_right(answer: str, key: str, exact: bool) -> bool:
    """exact: the answer's first number is the key, digit for digit (123456 and 012345 are not
    12345); else: the key's digits appear anywhere in the answer."""
    return answer_number(answer) == key if exact else key in answer


def generate_answers(llm, cases: list[PasskeyCase], max_tokens: int = 8) -> list[str]:
    """Greedy answers, all cases in one batch."""
    from oasiskv.sampling_params import SamplingParams

    outs = llm.generate([c.token_ids for c in cases], SamplingParams(temperature=0, max_tokens=max_tokens),
                        use_tqdm=False)
    return [o.text for o in outs]


def score(llm, cases: list[PasskeyCase], max_tokens: int = 8, exact: bool = False) -> list[bool]:
    return [is_right(a, c.key, exact) for c, a in zip(cases, generate_answers(llm, cases, max_tokens))]


def run_config(base, spec: str):
    """`dense`, or a sparse run: a drafter with optional sparse overrides (SparseConfig's fields),
    e.g. `self`, `oracle`, `self:fetch_ratio=0.02`, `self:fetch_ratio=1.0,top_k_blocks=64`."""
    if spec == "dense":
        return base.with_sparse(enabled=False)
    drafter, _, opts = spec.partition(":")
    overrides = dict(opt.split("=", 1) for opt in opts.split(",") if opt)
    return base.with_sparse(enabled=True, drafter=drafter, **{k: _flag_value(v) for k, v in overrides.items()})


def _flag_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _listed(values) -> str:
    return " ".join(map(str, values))


def add_passkey_args(p) -> None:
    p.add_argument("--set", default="suite", choices=["suite", "fresh"],
                   help="suite: repeated filler, --depths x --seeds, substring scoring; fresh: --fillers x "
                        "--depths x --seeds on standard library modules' source, exact-number scoring "
                        "(by default 30 prompts: 3 modules x 5 depths x 2 seeds)")
    p.add_argument("--context-len", type=int, default=4000, help="prompt tokens")
    p.add_argument("--keys", type=int, default=1, help="named keys per prompt (multi-key needles, "
                   "exact-number scoring when > 1)")
    p.add_argument("--depths", type=float, nargs="+", default=None,
                   help=f"where the key goes, 0..1 (suite: {_listed(SUITE_DEPTHS)}; fresh: {_listed(FRESH_DEPTHS)})")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help=f"key seeds (suite: {_listed(SUITE_SEEDS)}; fresh: {_listed(FRESH_SEEDS)})")
    p.add_argument("--fillers", nargs="+", default=list(FRESH_FILLERS),
                   help="fresh only: standard library modules whose source is the filler")
    p.add_argument("--drafters", nargs="+", default=["self"],
                   help="sparse runs to compare with dense: DRAFTER[:FIELD=VALUE,...], the fields "
                        "overriding the engine flags (e.g. self:fetch_ratio=0.02)")
    p.add_argument("--cases", nargs="+", default=None, metavar="FILLER:DEPTH:SEED",
                   help="only these cases of the set (e.g. argparse:0.45:10; the suite's filler is grass)")
    p.add_argument("--no-dense", action="store_true", help="the sparse runs only (dense is deterministic: "
                   "compare with an earlier run's)")
    p.add_argument("--output-json", default=None)


def run_passkey(args) -> int:
    """Dense, then each sparse run (the engine's sparse flags set K, window, cap, ...)."""
    import json
    from dataclasses import asdict, replace

    from oasiskv.entrypoints.args import engine_config
    from oasiskv.entrypoints.llm import LLM

    base = engine_config(args)
    if base.max_model_len is None:
        base = replace(base, max_model_len=args.context_len + 64)
    exact = args.set == "fresh" or args.keys > 1
    results = {"set": args.set, "keys": args.keys, "scoring": "exact number" if exact else "substring",
               "context_len": args.context_len,
               "sparse": {k: getattr(base.sparse, k) for k in (
                   "top_k_blocks", "sink_blocks", "window_blocks", "fetch_ratio", "sparse_threshold",
                   "summary_dtype", "fetch_budget")},
               "runs": {}}
    cases = None
    for spec in ([] if args.no_dense else ["dense"]) + list(args.drafters):
        cfg = run_config(base, spec)
        llm = LLM.from_config(cfg)
        if cases is None:
            if args.set == "fresh":
                cases = make_fresh_cases(llm.tokenizer, args.context_len, args.keys, args.fillers,
                                         args.depths or FRESH_DEPTHS, args.seeds or FRESH_SEEDS)
            else:
                cases = make_cases(llm.tokenizer, args.context_len, args.depths or SUITE_DEPTHS,
                                   args.seeds or SUITE_SEEDS, args.keys)
            if args.cases:
                cases = [c for c in cases if case_name(c) in set(args.cases)]
                if not cases:
                    raise ValueError(f"no case of the {args.set} set is named {' '.join(args.cases)}")
            results |= {"depths": sorted({c.depth for c in cases}), "seeds": sorted({c.seed for c in cases}),
                        "fillers": list(dict.fromkeys(c.filler for c in cases))}
        answers = generate_answers(llm, cases)
        right = [is_right(a, c.key, exact) for c, a in zip(cases, answers)]
        config = {"sparse": cfg.sparse.enabled} | {k: v for k, v in asdict(cfg.sparse).items()
                                                   if k in results["sparse"] or k == "drafter"}
        results["runs"][spec] = {"config": config, "correct": sum(right), "total": len(right), "per_case": [
            {"filler": c.filler, "depth": c.depth, "seed": c.seed, "key": c.key, "answer": a, "ok": ok}
            | ({"distractors": list(c.distractors)} if c.distractors else {})
            for c, a, ok in zip(cases, answers, right)]}
        print(f"{spec:>8}: {sum(right)}/{len(right)}", flush=True)
        del llm
        if args.output_json:  # after every run, so a long evaluation keeps what it measured
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=2)
    print_passkey_table(results)
    return 0


def print_passkey_table(results: dict) -> None:
    runs = results["runs"]
    print(f"\npasskey retrieval ({results['set']} set, {results.get('keys', 1)} key(s), {results['scoring']} scoring), "
          f"{results['context_len']} tokens; sparse: {results['sparse']}")
    print("| depth | " + " | ".join(runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for d in results["depths"]:
        cells = []
        for r in runs.values():
            oks = [c["ok"] for c in r["per_case"] if c["depth"] == d]
            cells.append(f"{sum(oks)}/{len(oks)}")
        print(f"| {d:.2f} | " + " | ".join(cells) + " |")
    print("| all | " + " | ".join(f"{r['correct']}/{r['total']}" for r in runs.values()) + " |")
    print("\n| run | right | wrong cases (filler, depth, seed: key -> answer) |\n|---|---|---|")
    for spec, r in runs.items():
        wrong = [f"{c['filler']} {c['depth']} {c['seed']}: {c['key']} -> {c['answer'].strip()!r}"
                 + (" (a distractor)" if answer_number(c["answer"]) in c.get("distractors", ()) else "")
                 for c in r["per_case"] if not c["ok"]]
        print(f"| {spec} | {r['correct']}/{r['total']} | {'; '.join(wrong) or '-'} |")
