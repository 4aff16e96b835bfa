"""Where a long-context decode step's GPU time goes, kernel by kernel: torch.profiler over the
`bench decode` steps (CUDA-graph replays), for dense, the sparse foreground alone (pipeline
stages off) and sparse with the pipeline. Per mode: the kernels by GPU time per step, the
foreground's idle time per step named by the kernels around each gap (`bench.trace_gaps`), the
transfer stream's busy and idle time (`kernel_idle`), and the chrome trace of a few steps (to see
what overlaps what).

PYTHONPATH=. python3 scripts/gpu_profile_sparse.py [--context 32768] [--batch 16] [--modes dense,fg,sparse]
    [--attention-splits N] [--attention-stages N]                 # the sparse runs' decode kernel
    [--stage-forks o_proj] [--transfer-programs 4:16:32]          # and their pipeline
    [--transfer-priorities high]                                  # (the first of each list)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from oasiskv.bench.decode import DecodeBench, add_decode_args  # noqa: E402
from oasiskv.bench.trace_gaps import trace_company, trace_gaps, trace_transfer_idle  # noqa: E402
from oasiskv.entrypoints.args import add_engine_args  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class ProfiledBench(DecodeBench):
    """`bench decode` whose timed steps run under the profiler (after its own warm-up)."""
    label = ""
    tables: dict = {}
    gaps: dict = {}
    transfer_idle: dict = {}
    company: dict = {}

    def _time(self, step, counters=None):
        for _ in range(self.args.warmup):
            step()
        _sync()
        n = self.args.steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                step()
            _sync()
        out = os.environ.get("OUT", "out")
        if self.label:
            trace = os.path.join(out, f"trace_{self.label}.json")
            prof.export_chrome_trace(trace)
            self.gaps[self.label] = gaps = trace_gaps(trace, n)
            print(f"--- {self.label}: foreground idle {sum(g['us_per_step'] for g in gaps) / 1e3:.2f} ms per step; "
                  "largest gaps (before -> after kernel):")
            for g in gaps[:12]:
                print(f"{g['us_per_step']:9.1f} us {g['per_step']:6.0f}x {g['us_each']:7.1f} us each  "
                      f"{g['before']} -> {g['after']}")
            t = self.transfer_idle[self.label] = trace_transfer_idle(trace, n)
            if t["calls"]:
                print(f"--- {self.label}: transfer busy {t['busy_us'] / 1e3:.2f} ms per step in {t['calls']:.0f} "
                      f"launches; idle before a launch: queued {t['idle_queued_us']:.0f} us "
                      f"({t['queued_per_step']:.0f}x), waited for its plan {t['idle_waited_us']:.0f} us "
                      f"({t['waited_per_step']:.0f}x), other {t['idle_other_us']:.0f} us ({t['other_per_step']:.0f}x)")
            company = self.company[self.label] = trace_company(trace, n)
            print(f"--- {self.label}: the attention's launches by what runs beside them (other streams):")
            for c in company[:10]:
                beside = ", ".join(f"{k} {v:.1f}" for k, v in sorted(c["overlap_us_each"].items(), key=lambda kv: -kv[1]))
                print(f"{c['per_step']:6.1f}x a step {c['us_each']:7.1f} us each  beside: {beside or 'nothing'}")
        rows = []
        for e in prof.key_averages():
            self_t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            # kernels and copies only: an aten:: row repeats the device time of the kernel it launched
            if self_t > 0 and e.count >= n and not e.key.startswith("aten::"):
                rows.append({"name": e.key[:90], "us_per_step": self_t / n, "calls_per_step": e.count / n})
        rows.sort(key=lambda r: -r["us_per_step"])
        self.tables[self.label] = rows
        total = sum(r["us_per_step"] for r in rows)
        print(f"--- {self.label}: {total / 1e3:.2f} ms of kernel time per step (summed over streams)")
        for r in rows[:30]:
            print(f"{r['us_per_step']:9.1f} us {r['calls_per_step']:6.0f}x  {r['name']}")
        # the step time itself: the bench's own timed loop, without the profiler
        return super()._time(step, counters)


def main():
    ap = argparse.ArgumentParser()
    add_decode_args(ap)
    add_engine_args(ap)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--modes", default="dense,fg,sparse")
    a = ap.parse_args(["--model", "qwen3-8b", "--load-format", "dummy", "--host-kv-gb", "82",
                       "--steps", "8", "--warmup", "4"] + sys.argv[1:])
    a.context_len, a.batch_size = a.context, a.batch
    os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
    bench = ProfiledBench(a)
    results = {}
    for mode in a.modes.split(","):
        bench.label = f"{mode}_b{a.batch}_{a.context // 1024}k"
        if mode == "dense":
            res = bench.run_dense(a.batch, a.context)
        else:
            # the first value of each tuning flag (`bench.tuning`); fg: the stages off
            tuning = dataclasses.replace(bench.tuning, stages=0) if mode == "fg" else bench.tuning
            res = bench.run_sparse(a.batch, a.context, tuning)
        results[bench.label] = res
        print(json.dumps({k: res.get(k) for k in ("mode", "step_ms", "output_tok_s", "roofline_fraction",
                                                 "stall_fraction", "foreground_ms")}), flush=True)
    out = os.environ.get("OUT", "out")
    with open(os.path.join(out, "sparse_profile.json"), "w") as f:
        json.dump({"results": results, "kernels": bench.tables, "foreground_gaps": bench.gaps,
                   "transfer_idle": bench.transfer_idle,
                   "attention_company": bench.company}, f, indent=2)


if __name__ == "__main__":
    main()
