"""The markdown table of scripts/gpu_bench_tp.sh's decode runs, and the two ratios that say
what tensor parallelism buys: size 2 over size 1 (dense, batch 16), and sparse over dense at each size.

    python3 scripts/tp_decode_table.py OUT_DIR    # reads decode_{tp1,tp2,big_tp2}.json there
"""
import json
import sys
from pathlib import Path


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    res = json.loads(path.read_text())
    return [dict(r, model=res["model"], tp=res.get("tensor_parallel_size", 1)) for r in res["runs"] if r.get("fits")]


def main(out: Path) -> None:
    runs = [r for name in ("tp1", "tp2", "big_tp2") for r in rows(out / f"decode_{name}.json")]
    print("| model | TP | mode | batch | context | output tok/s | step ms | roofline % (per GPU) | stall % "
          "| transfer GB/s per GPU |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in runs:
        sparse = r["mode"] == "sparse"
        print(f"| {r['model']} | {r['tp']} | {r['mode']} | {r['batch']} | {r['context']} | {r['output_tok_s']:,.0f} "
              f"| {r['step_ms']:.2f} | {100 * r['roofline_fraction']:.1f} "
              f"| {100 * r.get('stall_fraction', 0):.1f} | {r['transfer_gb_s'] if sparse else 0:.1f} |")
    best = {}
    for r in runs:  # the best run of each shape (several sparse runs differ in their settings only)
        key = (r["model"], r["tp"], r["mode"], r["batch"], r["context"])
        if r.get("prefetch", True) and (key not in best or r["output_tok_s"] > best[key]["output_tok_s"]):
            best[key] = r
    print()
    for (model, tp, mode, batch, context), r in sorted(best.items()):
        one = best.get((model, 1, mode, batch, context))
        if tp > 1 and one:
            print(f"- {model}, {mode}, batch {batch}, {context}: size {tp} / size 1 = "
                  f"{r['output_tok_s'] / one['output_tok_s']:.2f}x output tok/s")
        dense = best.get((model, tp, "dense", batch, context))
        if mode == "sparse" and dense:
            print(f"- {model}, size {tp}, batch {batch}, {context}: sparse / dense = "
                  f"{r['output_tok_s'] / dense['output_tok_s']:.2f}x")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
