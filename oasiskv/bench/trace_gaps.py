"""Where the foreground of a profiled decode step sits idle: the time between consecutive
kernels on the stream that runs the attention, read from a torch.profiler chrome trace.

A kernel that cannot start when the one before it ends is waiting for something: SMs held by
another stream's blocks, an event, or the host. Each gap is named by the pair of kernels around
it (the GEMM after the attention is o_proj, the one after the norm that follows it is gate_up),
so a table of gaps per step says which launch waits, and for how long, beside the pipeline
against alone.

The transfer stream's own idle time (`kernel_idle`) says the other half: whether the transfer
is the queue the step waits on, or keeps pace and waits for each layer's plan.
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


def kernel_idle(events: list[dict], steps: int, kernel: str, waits_on: str | None = None,
                back_to_back_us: float = 2.0) -> dict:
    """How busy the stream of one kernel kind is (the transfer's `_fetch_kernel`, say) and why it
    idles: per step, its busy µs and the idle µs between consecutive launches, split into
    launches that started right after the one before (a queue: the stream was the bottleneck),
    right after a `waits_on` kernel ended (the launch waited for its input: the stream kept
    pace), and the rest. A gap is "right after" within `back_to_back_us`."""
    def named(prefix):
        return sorted((e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"
                       and e["name"].startswith(prefix)), key=lambda e: e["ts"])
    runs = named(kernel)
    inputs = [e["ts"] + e["dur"] for e in named(waits_on)] if waits_on else []
    out = {"calls": len(runs) / steps, "busy_us": sum(e["dur"] for e in runs) / steps}
    count = dict.fromkeys(("queued", "waited", "other"), 0)
    idle = dict.fromkeys(count, 0.0)
    for before, after in zip(runs, runs[1:]):
        gap = max(0.0, after["ts"] - (before["ts"] + before["dur"]))
        if gap <= back_to_back_us:
            kind = "queued"
        elif any(0 <= after["ts"] - end <= back_to_back_us for end in inputs):
            kind = "waited"
        else:
            kind = "other"
        count[kind] += 1
        idle[kind] += gap
    out |= {f"{k}_per_step": v / steps for k, v in count.items()}
    out |= {f"idle_{k}_us": v / steps for k, v in idle.items()}
    return out


def trace_gaps(path: str, steps: int) -> list[dict]:
    """`foreground_gaps` of a chrome trace file (`prof.export_chrome_trace`)."""
    with open(path) as f:
        return foreground_gaps(json.load(f)["traceEvents"], steps)


def trace_transfer_idle(path: str, steps: int) -> dict:
    """`kernel_idle` of the transfer stream in a chrome trace file: the fetch kernels, each
    waiting on its layer's plan (the capped-eviction kernel)."""
    with open(path) as f:
        return kernel_idle(json.load(f)["traceEvents"], steps, "_fetch_kernel", "_capped_eviction_kernel")


def kernel_company(events: list[dict], steps: int, kernel: str = ATTENTION) -> list[dict]:
    """What runs beside each launch of one kernel kind (the foreground's attention, say) on the
    other streams, and how long that launch takes in each company. One row per set of kernel
    names overlapping a launch (empty: it ran alone): launches per step, µs each, and each
    companion's overlap µs per launch. A kernel slower in the step than alone is slowed by
    whatever its slow rows name."""
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    runs = [e for e in kernels if e["name"].startswith(kernel)]
    rows: dict = {}
    for run in runs:
        start, end, stream = run["ts"], run["ts"] + run["dur"], run.get("args", {}).get("stream")
        overlap = defaultdict(float)
        for other in kernels:
            if other.get("args", {}).get("stream") == stream:
                continue
            shared = min(end, other["ts"] + other["dur"]) - max(start, other["ts"])
            if shared > 0:
                overlap[short_name(other["name"])] += shared
        key = tuple(sorted(overlap))
        row = rows.setdefault(key, {"company": list(key), "count": 0, "us": 0.0, "overlap": defaultdict(float)})
        row["count"] += 1
        row["us"] += run["dur"]
        for name, us in overlap.items():
            row["overlap"][name] += us
    out = [{"company": r["company"], "per_step": r["count"] / steps, "us_each": r["us"] / r["count"],
            "overlap_us_each": {k: v / r["count"] for k, v in r["overlap"].items()}} for r in rows.values()]
    return sorted(out, key=lambda r: -r["per_step"])


def trace_company(path: str, steps: int) -> list[dict]:
    """`kernel_company` of the attention in a chrome trace file."""
    with open(path) as f:
        return kernel_company(json.load(f)["traceEvents"], steps)
