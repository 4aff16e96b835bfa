"""The scenario table from `gpu_bench_serve.sh scenarios`' bench results: one JSON (every
figure of both servers per scenario, and the ratios) and one Markdown table.

python3 scripts/scenario_table.py OUT_DIR --kv-cache-gb 24 --scenarios r48x6k r24x10k ...
"""
from __future__ import annotations

import argparse
import json
import os

LOADS = {"r48x6k": (48, 1024, 6144), "r24x10k": (24, 1024, 10240), "r16x16k": (16, 1024, 16384),
         "l16x16k": (16, 16384, 512), "l8x32k": (8, 32768, 1024),
         "m12x4k": (12, 4096, 2048), "m16x8k": (16, 8192, 2048), "m4x36k": (4, 36864, 512), "c36x16k": (36, 16384, 1024)}


def load(out_dir: str, name: str, case: str) -> dict | None:
    path = os.path.join(out_dir, f"bench_serve_{name}_{case}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def row(name: str, dense: dict | None, sparse: dict | None) -> dict:
    n, i, o = LOADS[name]
    r = {"scenario": name, "prompts": n, "input_len": i, "output_len": o}
    for case, res in (("dense", dense), ("sparse", sparse)):
        if res is None:
            continue
        r[case] = {k: res.get(k) for k in (
            "completed", "failed", "duration", "output_throughput", "median_tpot_ms", "p99_tpot_ms",
            "median_itl_ms", "p99_itl_ms", "median_ttft_ms", "num_preemptions", "sparse_conversions",
            "sparse_decode_steps", "sparse_step_stall_s", "sparse_step_stall_frac", "sparse_step_gb_per_request",
            "sparse_step_budget_use", "sparse_step_hit_rate")}
    if dense and sparse and dense.get("output_throughput"):
        r["ratio"] = sparse["output_throughput"] / dense["output_throughput"]
    return r


def markdown(rows: list[dict], kv_gb: str) -> str:
    f = lambda v, fmt: "–" if v is None else format(v, fmt)  # noqa: E731
    lines = [f"KV limit: {kv_gb + ' GiB' if kv_gb else 'none (the GPU memory left)'}", "",
             "| scenario | dense tok/s | sparse tok/s | sparse / dense | TPOT median dense / sparse (ms) | "
             "ITL median dense / sparse (ms) | stall (% of sparse step) | GB host→GPU per request | "
             "hit rate | preemptions dense / sparse | conversions |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        d, s = r.get("dense", {}), r.get("sparse", {})
        load = f"{r['prompts']} × ({r['input_len'] // 1024}K in, {r['output_len'] / 1024:g}K out)"
        stall = s.get("sparse_step_stall_frac")
        hit = s.get("sparse_step_hit_rate")
        lines.append(
            f"| {load} | {f(d.get('output_throughput'), ',.0f')} | {f(s.get('output_throughput'), ',.0f')} | "
            f"**{f(r.get('ratio'), '.2f')}×** | {f(d.get('median_tpot_ms'), '.1f')} / {f(s.get('median_tpot_ms'), '.1f')} | "
            f"{f(d.get('median_itl_ms'), '.1f')} / {f(s.get('median_itl_ms'), '.1f')} | "
            f"{f(None if stall is None else 100 * stall, '.2f')} | {f(s.get('sparse_step_gb_per_request'), '.2f')} | "
            f"{f(None if hit is None else 100 * hit, '.0f')}% | {f(d.get('num_preemptions'), 'd')} / "
            f"{f(s.get('num_preemptions'), 'd')} | {f(s.get('sparse_conversions'), 'd')} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--kv-cache-gb", default="24")
    ap.add_argument("--scenarios", nargs="+", default=list(LOADS))
    a = ap.parse_args()
    rows = [row(n, load(a.out_dir, n, "dense"), load(a.out_dir, n, "sparse")) for n in a.scenarios]
    with open(os.path.join(a.out_dir, "scenarios.json"), "w") as f:
        json.dump({"kv_cache_gb": a.kv_cache_gb or None, "scenarios": rows}, f, indent=2)
    table = markdown(rows, a.kv_cache_gb)
    with open(os.path.join(a.out_dir, "scenarios.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
