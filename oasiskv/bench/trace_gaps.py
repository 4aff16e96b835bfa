"""Where the foreground of a profiled decode step sits idle: the time between consecutive
kernels on the stream that runs the attention, read from a torch.profiler chrome trace.

A kernel that cannot start when the one before it ends is waiting for something: SMs held by
another stream's blocks, an event, or the host. Each gap is named by the pair of kernels around
it (the GEMM after the attention is o_proj, the one after the norm that follows it is gate_up),
so a table of gaps per step says which launch waits, and for how long, beside the pipeline
against alone.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict

ATTENTION = "_decode_split_kernel"
# The pipeline's kernels: left out of the foreground's sequence even if a graph replay ran one
# of them on the attention's stream.
PIPELINE_KERNELS = ("_bounds_kernel", "_select_kernel", "_capped_eviction_kernel", "_fetch_kernel",
                    "_write_through_kernel", "_copy_items_kernel")


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and parameters, cut to 48 characters."""
    return re.split(r"[<(]", name, maxsplit=1)[0].removeprefix("void ").strip()[:48]


def foreground_gaps(events: list[dict], steps: int, marker: str = ATTENTION) -> list[dict]:
    """events: a chrome trace's "traceEvents"; steps: how many decode steps the trace holds.
    Returns one row per (kernel before, kernel after) pair on the foreground: idle µs per step,
    how often per step, and µs per occurrence, largest first."""
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    streams = {e.get("args", {}).get("stream") for e in kernels if e["name"].startswith(marker)}
    fg = sorted((e for e in kernels if e.get("args", {}).get("stream") in streams
                 and not e["name"].startswith(PIPELINE_KERNELS)), key=lambda e: e["ts"])
    total = defaultdict(float)
    count = defaultdict(int)
    for before, after in zip(fg, fg[1:]):
        key = (short_name(before["name"]), short_name(after["name"]))
        total[key] += max(0.0, after["ts"] - (before["ts"] + before["dur"]))
        count[key] += 1
    rows = [{"before": b, "after": a, "us_per_step": total[b, a] / steps, "per_step": count[b, a] / steps,
             "us_each": total[b, a] / count[b, a]} for b, a in total]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def trace_gaps(path: str, steps: int) -> list[dict]:
    """`foreground_gaps` of a chrome trace file (`prof.export_chrome_trace`)."""
    with open(path) as f:
        return foreground_gaps(json.load(f)["traceEvents"], steps)
