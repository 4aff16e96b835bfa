"""Accuracy against the fetch cap and the top-K size: a fetch-cap ablation and a top-K
sensitivity sweep, on one model.

For each sparse setting, on the same prompts: passkey retrieval (oasiskv.eval.passkey) and
teacher-forced fidelity to dense (oasiskv.eval.fidelity). Settings: the fetch ratio swept at
a fixed K, then K swept at a fixed ratio. Two ratios that give the same cap C = ceil(ratio·K)
are the same engine, so each (K, C) runs once.
"""
from __future__ import annotations

import json
from dataclasses import replace


def add_ablation_args(p) -> None:
    p.add_argument("--fetch-ratios", type=float, nargs="+", default=[0.01, 0.02, 0.05, 0.1, 0.2, 1.0],
                   help="swept at --base-k; 1.0 = fetch-all")
    p.add_argument("--ks", type=int, nargs="+", default=[16, 32, 64, 128],
                   help="top-K blocks, swept at --base-fetch-ratio")
    p.add_argument("--base-k", type=int, default=32)
    p.add_argument("--base-fetch-ratio", type=float, default=0.05)
    p.add_argument("--texts", nargs="+", default=["code"], help="fidelity texts (see eval fidelity)")
    p.add_argument("--context-len", type=int, default=3000, help="fidelity prompt tokens")
    p.add_argument("--forced-tokens", type=int, default=128)
    p.add_argument("--passkey-context-len", type=int, default=3000)
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG: accuracy against fetch ratio and against K")


def settings(args) -> list[tuple[str, int, float]]:
    """(sweep, K, fetch ratio), the ratio sweep first."""
    return ([("fetch_ratio", args.base_k, r) for r in args.fetch_ratios]
            + [("k", k, args.base_fetch_ratio) for k in args.ks])


def accuracy(llm, cases, ref) -> dict:
    from oasiskv.eval.fidelity import measure_sparse
    from oasiskv.eval.passkey import score

    right = score(llm, cases)
    return {"passkey_correct": sum(right), "passkey_total": len(right)} | measure_sparse(llm, ref, 0)


def run_ablation(args) -> int:
    from oasiskv.entrypoints.args import engine_config
    from oasiskv.entrypoints.llm import LLM
    from oasiskv.eval.fidelity import dense_reference
    from oasiskv.eval.passkey import make_cases, score

    base = engine_config(args)
    longest = max(args.context_len + args.forced_tokens, args.passkey_context_len + 8)
    threshold = min(base.sparse.sparse_threshold, args.context_len, args.passkey_context_len - 64)
    base = replace(base.with_sparse(sparse_threshold=threshold), max_model_len=base.max_model_len or longest + 16)
    dense = LLM.from_config(base.with_sparse(enabled=False))
    cases = make_cases(dense.tokenizer, args.passkey_context_len, args.depths, args.seeds)
    ref = dense_reference(dense, args.texts, args.context_len, args.forced_tokens, 0)
    right = score(dense, cases)
    results = {"context_len": args.context_len, "texts": args.texts, "forced_tokens": args.forced_tokens,
               "passkey_context_len": args.passkey_context_len, "depths": args.depths, "seeds": args.seeds,
               "drafter": base.sparse.drafter, "window_blocks": base.sparse.window_blocks,
               "sink_blocks": base.sparse.sink_blocks,
               "dense": {"passkey_correct": sum(right), "passkey_total": len(right),
                         "ppl": accuracy_ppl(ref)},
               "runs": []}
    del dense
    done: dict[tuple[int, int], dict] = {}
    for sweep, k, ratio in settings(args):
        cfg = base.with_sparse(enabled=True, top_k_blocks=k, fetch_ratio=ratio)
        cap = cfg.sparse.fetch_cap
        if (k, cap) not in done:
            done[(k, cap)] = accuracy(LLM.from_config(cfg), cases, ref)
        row = {"sweep": sweep, "top_k_blocks": k, "fetch_ratio": ratio, "fetch_cap": cap} | done[(k, cap)]
        results["runs"].append(row)
        print(f"K={k:>4} ratio={ratio:<5} C={cap:<4} passkey {row['passkey_correct']}/{row['passkey_total']} "
              f"top-1 {100 * row['top1_agreement']:.2f}% ppl x{row['ppl_ratio']:.4f}", flush=True)
        if args.output_json:  # after every setting: a long run stopped early keeps what it measured
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=1)
    if args.plot:
        plot_ablation(results, args.plot)
    if args.json:
        print(json.dumps(results))
    else:
        print_ablation_table(results)
    return 0


def accuracy_ppl(ref) -> float:
    """Dense perplexity over the same decode steps the sparse runs are scored on."""
    import math

    import torch
    lp = torch.cat([x[1:] for x in ref.logprobs])
    t = torch.tensor([tok for c in ref.continuations for tok in c[1:]])
    return math.exp(float(-lp.gather(1, t[:, None]).mean()))


def print_ablation_table(res: dict) -> None:
    d = res["dense"]
    print(f"\naccuracy against the fetch cap and K; drafter {res['drafter']}, window {res['window_blocks']}, "
          f"sink {res['sink_blocks']}; passkey at {res['passkey_context_len']} tokens, fidelity over "
          f"{res['texts']} at {res['context_len']} tokens + {res['forced_tokens']} forced")
    print("| sweep | K | fetch ratio | C | passkey | top-1 vs dense | mean KL | ppl | ppl / dense |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| dense | - | - | - | {d['passkey_correct']}/{d['passkey_total']} | - | - | {d['ppl']:.4f} | 1 |")
    for r in res["runs"]:
        ratio = "all" if r["fetch_ratio"] >= 1 else f"{r['fetch_ratio']:g}"
        print(f"| {r['sweep']} | {r['top_k_blocks']} | {ratio} | {r['fetch_cap']} | "
              f"{r['passkey_correct']}/{r['passkey_total']} | {100 * r['top1_agreement']:.2f}% | "
              f"{r['kl_mean']:.5f} | {r['ppl_sparse']:.4f} | {r['ppl_ratio']:.4f} |")


def plot_ablation(res: dict, path: str) -> None:
    from oasiskv.eval.plots import line_panels

    d = res["dense"]
    panels = []
    for sweep, key, xlabel in (("fetch_ratio", "fetch_ratio", "fetch ratio (1 = fetch-all)"),
                               ("k", "top_k_blocks", "K (blocks)")):
        rows = [r for r in res["runs"] if r["sweep"] == sweep]
        if not rows:
            continue
        fixed = (f"K={rows[0]['top_k_blocks']}" if sweep == "fetch_ratio"
                 else f"fetch ratio {rows[0]['fetch_ratio']:g}")
        panels.append({
            "title": f"accuracy against {xlabel.split(' (')[0]}, {fixed} (1 = as dense)", "xlabel": xlabel,
            "ylabel": "relative to dense", "x": [r[key] for r in rows], "xlog": True,
            "xticks": ["all" if r[key] >= 1 and sweep == "fetch_ratio" else f"{r[key]:g}" for r in rows],
            "series": {
                "passkey (sparse / dense)": [r["passkey_correct"] / max(d["passkey_correct"], 1) for r in rows],
                "top-1 agreement with dense": [r["top1_agreement"] for r in rows],
                "dense ppl / sparse ppl": [1 / r["ppl_ratio"] for r in rows]}})
    line_panels(path, panels)
