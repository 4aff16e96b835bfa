"""Lookahead agreement: how well each drafter's query predicts the blocks the next step needs
(the target: >= 98% per layer, and >= 10 points above the previous-token proxy), and how
much of the next token's true attention mass the summaries' top-K covers.

`oasiskv eval agreement` runs the real engine, sparse with a full budget (every block held,
no cap, so decoding is exactly dense and each drafter sees the same continuation), with a
`LookaheadRecorder` observing each layer. One engine run per drafter that sends a draft
token; `prev` is measured in each of them from the current token's row (from the first run).
Greedy and temperature-sampled continuations are recorded separately.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace

MODES = ("greedy", "sampled")


def add_agreement_args(p) -> None:
    p.add_argument("--texts", nargs="+", default=["code", "prose"],
                   help="code (Python's typing module), prose (a license text), manual (the language "
                        "reference's topics, ~100K tokens of English) or file paths")
    p.add_argument("--context-len", type=int, default=6000, help="prompt tokens of each text")
    p.add_argument("--steps", type=int, default=32, help="decode steps measured per text and mode")
    p.add_argument("--ks", type=int, nargs="+", default=[16, 32, 64], help="top-K sizes (blocks)")
    p.add_argument("--k", type=int, default=32, help="the K of the headline figures and the plot")
    p.add_argument("--drafters", nargs="+", default=["self", "ngram", "prev", "oracle"])
    p.add_argument("--temperature", type=float, default=0.8, help="of the sampled mode")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG: agreement and mass coverage per layer")


def full_budget_config(args, base, drafter: str):
    """Sparse with every block held and no cap: predictions are recorded, never felt."""
    blocks = math.ceil((args.context_len + args.steps + 4) / base.block_size)
    sparse = base.with_sparse(enabled=True, drafter=drafter, top_k_blocks=max(blocks, max(args.ks)), fetch_ratio=1.0,
                              sparse_threshold=min(base.sparse.sparse_threshold, args.context_len))
    # The recorder observes each layer's stages: the pipeline's steps run eager and in order.
    in_order = replace(base.pipeline_tuning, background=False)
    return replace(sparse, max_model_len=base.max_model_len or args.context_len + args.steps + 16,
                   pipeline_tuning=in_order, enforce_eager=True)


def record_drafter(args, base, drafter: str, prompts_of) -> dict:
    """One engine run: both modes, every text. Returns {mode: (recorder, draft acceptance)}."""
    from oasiskv.entrypoints.llm import LLM
    from oasiskv.eval.lookahead_recorder import LookaheadRecorder
    from oasiskv.sampling_params import SamplingParams

    llm = LLM.from_config(full_budget_config(args, base, drafter))
    prompts = prompts_of(llm.tokenizer)
    pipeline = llm.engine.runner.pipeline
    out = {}
    for mode in MODES:
        rec = LookaheadRecorder(llm.engine.runner.model_config.num_layers, args.ks, drafter)
        pipeline.observers[:] = [rec]
        # +2: the first token comes from the (dense) prefill, the first sparse step has no
        # earlier prediction to check; then `steps` checked predictions per text.
        params = [SamplingParams(temperature=0 if mode == "greedy" else args.temperature,
                                 seed=base.seed + i, max_tokens=args.steps + 2, ignore_eos=True)
                  for i in range(len(prompts))]
        outs = llm.generate(prompts, params, use_tqdm=False)
        acc = [o.stats["draft_acceptance"] for o in outs if o.stats.get("draft_acceptance") is not None]
        out[mode] = (rec, sum(acc) / len(acc) if acc else None)
        print(f"{drafter:>7} {mode}: {int(rec.steps[0])} predictions per layer checked", flush=True)
    pipeline.observers[:] = []
    return out


def summarize(recorders: dict, ks: list[int]) -> dict:
    """{predictor: {"mean", "per_layer"}} for agreement and coverage at every K."""
    def stats(rec, table, name, k):
        per_layer = rec.per_layer(table, name, k)
        return {"mean": sum(per_layer) / len(per_layer), "min": min(per_layer), "per_layer": per_layer}
    res = {"agreement": {}, "coverage": {}}
    for name, rec in recorders.items():
        res["agreement"][name] = {str(k): stats(rec, "agreement", name, k) for k in ks}
        for cov in ([name, "quest", "best"] if name != "prev" else [name]):
            res["coverage"].setdefault(cov, {str(k): stats(rec, "coverage", cov, k) for k in ks})
    return res


def run_agreement(args) -> int:
    from oasiskv.entrypoints.args import engine_config
    from oasiskv.eval.lookahead_recorder import LookaheadRecorder
    from oasiskv.eval.texts import text_tokens

    if args.k not in args.ks:
        raise ValueError(f"--k {args.k} must be one of --ks {args.ks}")
    unknown = set(args.drafters) - {"self", "ngram", "prev", "oracle"}
    if unknown:
        raise ValueError(f"agreement measures self, ngram, prev, oracle; not {sorted(unknown)}")
    base = engine_config(args)
    prompts_of = lambda tok: [text_tokens(tok, t, args.context_len) for t in args.texts]
    runs = [d for d in args.drafters if d != "prev"] or ["prev"]
    by_mode = {mode: {} for mode in MODES}  # mode -> predictor -> recorder
    acceptance = {mode: {} for mode in MODES}
    for drafter in runs:
        for mode, (rec, acc) in record_drafter(args, base, drafter, prompts_of).items():
            by_mode[mode][drafter] = rec
            acceptance[mode][drafter] = acc
            if "prev" in args.drafters and "prev" not in by_mode[mode]:
                by_mode[mode]["prev"] = rec  # the current-token row, same tokens in every run
    pooled = {}
    for mode in MODES:
        for name, rec in by_mode[mode].items():
            pooled.setdefault(name, LookaheadRecorder(len(rec.steps), args.ks, rec.drafter)).merge(rec)
    results = {
        "context_len": args.context_len, "steps": args.steps, "texts": args.texts, "ks": args.ks,
        "k": args.k, "temperature": args.temperature, "window_blocks": base.sparse.window_blocks,
        "sink_blocks": base.sparse.sink_blocks, "block_size": base.block_size,
        "by_mode": {mode: summarize(by_mode[mode], args.ks) | {"draft_acceptance": acceptance[mode]}
                    for mode in MODES},
        "pooled": summarize(pooled, args.ks),
    }
    results["by_draft"] = {d: draft_outcomes({m: by_mode[m][d].finish() for m in MODES}, args.k)
                           for d in runs if d != "prev"}
    head = results["pooled"]["agreement"]
    results["drafters"] = {d: {"mean": head[d][str(args.k)]["mean"], "per_layer": head[d][str(args.k)]["per_layer"]}
                           for d in args.drafters}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot_agreement(results, args.plot)
    if args.json:
        print(json.dumps(results))
    else:
        print_agreement_tables(results)
    return 0


def draft_outcomes(logs: dict, k: int) -> dict:
    """Per mode, a drafter's checked steps split by whether the draft token was the real one:
    the mean agreement at K of each part, and the steps (their index in each request's run)
    where the draft was wrong: early ones are cold starts, later ones a chain that broke."""
    out = {}
    for mode, log in logs.items():
        parts = {}
        for name, right in (("right", True), ("wrong", False)):
            steps = [e for e in log if e["draft_right"] is right]
            parts[name] = {"steps": len(steps), "agreement": (sum(e["agreement"][str(k)] for e in steps) / len(steps)
                                                              if steps else None)}
        parts["wrong_at_steps"] = [e["step"] for e in log if e["draft_right"] is False]
        out[mode] = parts | {"log": log}
    return out


def print_agreement_tables(res: dict) -> None:
    ks, k = res["ks"], str(res["k"])
    print(f"\nlookahead agreement |P ∩ T| / K, mean over layers (worst layer), {res['context_len']}-token "
          f"context, texts {res['texts']}, {res['steps']} steps per text and mode")
    cols = [(m, str(kk)) for m in MODES for kk in ks]
    print("| drafter | " + " | ".join(f"{m} K={kk}" for m, kk in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for d in res["drafters"]:
        cells = [res["by_mode"][m]["agreement"][d][kk] for m, kk in cols]
        print(f"| {d} | " + " | ".join(f"{100 * c['mean']:.1f}% ({100 * c['min']:.1f})" for c in cells) + " |")
    print(f"\nattention mass of the next token inside sink + window + the K blocks (K={k}, mean over layers)")
    names = list(res["pooled"]["coverage"])
    print("| blocks | " + " | ".join(MODES) + " |")
    print("|---" * (len(MODES) + 1) + "|")
    for n in names:
        print(f"| {n} | " + " | ".join(f"{res['by_mode'][m]['coverage'][n][k]['mean']:.4f}" for m in MODES) + " |")
    print("\ndraft acceptance: " + ", ".join(f"{m}: " + ", ".join(
        f"{d} {a:.3f}" for d, a in res["by_mode"][m]["draft_acceptance"].items() if a is not None)
        for m in MODES))
    for d, modes in res.get("by_draft", {}).items():
        for mode, o in modes.items():
            right, wrong = o["right"], o["wrong"]
            fmt = lambda a: "-" if a is None else f"{100 * a:.1f}%"  # noqa: E731
            print(f"{d} {mode}: draft right {right['steps']} steps, agreement {fmt(right['agreement'])}; "
                  f"wrong {wrong['steps']} steps, agreement {fmt(wrong['agreement'])}, at steps {o['wrong_at_steps']}")
    print(f"\nper layer, K={k}, both modes pooled: agreement of each drafter; coverage of the Quest top-K")
    drafters = list(res["drafters"])
    print("| layer | " + " | ".join(drafters) + " | quest mass | best mass |")
    print("|---" * (len(drafters) + 3) + "|")
    cov = res["pooled"]["coverage"]
    for layer in range(len(next(iter(res["drafters"].values()))["per_layer"])):
        cells = [f"{100 * res['drafters'][d]['per_layer'][layer]:.1f}%" for d in drafters]
        extra = [f"{cov[n][k]['per_layer'][layer]:.3f}" if n in cov else "-" for n in ("quest", "best")]
        print(f"| {layer} | " + " | ".join(cells + extra) + " |")


def plot_agreement(res: dict, path: str) -> None:
    from oasiskv.eval.plots import line_panels

    k = str(res["k"])
    first = next(iter(res["drafters"].values()))["per_layer"]
    layers = list(range(len(first)))
    cov = res["pooled"]["coverage"]
    line_panels(path, [
        {"title": f"top-{k} agreement with the next token's own top-{k}", "xlabel": "layer",
         "ylabel": "|P ∩ T| / K", "x": layers,
         "series": {d: v["per_layer"] for d, v in res["drafters"].items()}},
        {"title": f"next token's attention mass in sink + window + {k} blocks", "xlabel": "layer",
         "ylabel": "attention mass covered", "x": layers,
         "series": {n: cov[n][k]["per_layer"] for n in cov}},
    ], title=f"{res['context_len']}-token context, texts {', '.join(res['texts'])}, greedy + sampled")
