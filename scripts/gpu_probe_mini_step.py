"""Do the step's GEMMs make the transfer slow the attention? (prepared in the eighth session,
not run yet.) In the batch 16, 16K step the working-set attention with 5 stages takes 39 µs a
layer with the pipeline off and 53.5 µs beside the fetch (host pool on huge pages), yet the
attention-only probe (`gpu_probe_attention_beside.py`, the step's footprint) takes 44 µs beside
the same fetch. The step has GEMMs between the attentions; that probe has none.

Here a mini step runs the foreground's big kernels of 36 layers in one graph: the qkv GEMM, the
attention (as in that probe), o_proj, gate_up and down (qwen3-8b shapes, 32 rows: 16 requests
and their lookahead tokens, a weight set per layer so nothing stays in L2), through cuBLASLt
with the step's 8-SM carve-out. It is timed alone and beside one step's transfer, then profiled
both ways; the profile gives each kernel's own time, and the attention's by what ran beside it
(`bench.trace_gaps.kernel_company`).

Prediction. If the GEMMs are what the probe lacked, the attention beside the fetch takes ~53 µs
here (against ~44 in the attention-only probe) and ~39 alone. If it stays at ~44, what slows it
in the step is the pipeline's own schedule (when each fetch starts, the other stages' kernels),
not the GEMMs.

--transfer "uva 4 w32" (ninth session) puts the fetch on 4 programs that each hold a whole SM
(`gpu_probe_attention_beside.TRANSFERS`), so no attention program shares an SM with one.

    PYTHONPATH=. python3 scripts/gpu_probe_mini_step.py [--stages 5] [--blocks 1024] [--transfer "uva 8"] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_check_pipeline import capture, report, time_eager  # scripts/ is on the path when run as a script
from gpu_probe_attention_beside import L, R, attend, dev, time_beside, transfer_graphs, working_sets
from oasiskv.bench.trace_gaps import kernel_company, short_name
from oasiskv.sparse.decode_step import foreground_gemms
from oasiskv.sparse.pipeline import GEMM_SM_CARVEOUT

HIDDEN, INTER, QKV = 4096, 12288, (32 + 2 * 8) * 128  # qwen3-8b
ROWS = 2 * R  # each request's token and its lookahead token


def mini_step_graph(layers: list, stages: int) -> tuple[torch.cuda.CUDAGraph, list]:
    """The graph, and the weights and activations it reads, which must outlive it."""
    weights = [tuple(torch.empty(n, k, device=dev, dtype=torch.bfloat16).normal_(0, 0.02)
                     for n, k in ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)))
               for _ in range(L)]
    x = torch.randn(ROWS, HIDDEN, device=dev, dtype=torch.bfloat16)

    def step():
        for i in range(L):
            w_qkv, w_o, w_gate_up, w_down = weights[i]
            torch.mm(x, w_qkv.t())
            out = attend(layers[i % len(layers)], stages)
            hidden = torch.mm(out.view(ROWS, HIDDEN), w_o.t())
            gate_up = torch.mm(hidden, w_gate_up.t())
            torch.mm(gate_up[:, :INTER], w_down.t())

    with foreground_gemms(GEMM_SM_CARVEOUT):
        graph = capture(step)
    return graph, [weights, x]


def profiled(run, path: str, reps: int) -> dict:
    """Each kernel's mean µs in `run` (which replays the mini step `reps` times), and the
    attention's launches by their company."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    total, count = defaultdict(float), defaultdict(int)
    for e in events:
        if e.get("cat") == "kernel" and e.get("ph") == "X":
            total[short_name(e["name"])] += e["dur"]
            count[short_name(e["name"])] += 1
    return {"kernel us each": {k: total[k] / count[k] for k in total},
            "launches": dict(count), "attention company": kernel_company(events, reps)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=5, help="the attention's load stages")
    ap.add_argument("--attention-buffers", type=int, default=36)
    ap.add_argument("--blocks", type=int, default=1024, help="context blocks per request (host extent size)")
    ap.add_argument("--transfer", default="uva 8", help="the fetch beside it (gpu_probe_attention_beside.TRANSFERS)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    res: dict = {"stages": args.stages, "attention buffers": args.attention_buffers, "blocks": args.blocks,
                 "transfer": args.transfer}
    layers = working_sets(args.attention_buffers)
    graph, _inputs = mini_step_graph(layers, args.stages)
    transfers, _buffers = transfer_graphs(res, [args.transfer], args.blocks, [x[3] for x in layers])
    fetch = transfers[args.transfer]
    reps = 3  # a mini step is ~6 ms; 5 fetch replays (~5.5 ms each) outlast 3 of them
    res["mini step alone ms"] = time_eager(graph.replay)
    res["mini step beside the fetch ms"] = time_beside(graph, fetch, reps=reps, transfer_reps=5)
    res["profile alone"] = profiled(lambda: [graph.replay() for _ in range(reps)],
                                    os.path.join(out_dir, "trace_mini_step_alone.json"), reps)
    res["profile beside the fetch"] = profiled(lambda: time_beside(graph, fetch, reps=reps, transfer_reps=5),
                                           os.path.join(out_dir, "trace_mini_step_beside.json"), reps)
    for label in ("profile alone", "profile beside the fetch"):
        p = res[label]
        print(f"--- {label}: kernel µs each (launches)")
        for k, v in sorted(p["kernel us each"].items(), key=lambda kv: -kv[1])[:8]:
            print(f"{v:9.1f} us ({p['launches'][k]})  {k}")
        for c in p["attention company"][:4]:
            print(f"  attention {c['per_step']:5.1f}x a step {c['us_each']:6.1f} us each beside "
                  f"{', '.join(c['company']) or 'nothing'}")
    report({k: v for k, v in res.items() if not isinstance(v, dict)}, None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
