"""The foreground idle-time table read from a profiler trace (oasiskv/bench/trace_gaps.py)."""
import json

import pytest

from oasiskv.bench.trace_gaps import (foreground_gaps, kernel_company, kernel_idle, short_name, trace_company,
                                     trace_gaps, trace_transfer_idle)


def kernel(name, ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def two_steps():
    """Two steps of one layer on stream 7: qkv GEMM, attention, o_proj GEMM; the pipeline's
    bounds kernel on stream 9, and once on stream 7 (a replay may put it there); a CPU op."""
    gemm = "nvjet_sm90_tst_64x32_64x16_4x1_v_bz_TNT"
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]
    for t0 in (0, 100):
        events += [kernel(gemm, t0, 10, 7), kernel("_decode_split_kernel", t0 + 12, 20, 7),
                   kernel("_bounds_kernel", t0 + 32, 15, 9), kernel(gemm, t0 + 40, 10, 7)]
    events.append(kernel("_bounds_kernel", 33, 5, 7))
    return events


def test_gaps_are_named_by_the_kernels_around_them():
    rows = {(r["before"], r["after"]): r for r in foreground_gaps(two_steps(), steps=2)}
    gemm = "nvjet_sm90_tst_64x32_64x16_4x1_v_bz_TNT"
    # o_proj waits 8 µs after the attention in each step; qkv -> attention 2 µs; the gap
    # between the steps (o_proj of step 0 -> qkv of step 1) 50 µs, once in two steps.
    assert rows[("_decode_split_kernel", gemm)]["us_per_step"] == pytest.approx(8.0)
    assert rows[(gemm, "_decode_split_kernel")]["us_each"] == pytest.approx(2.0)
    assert rows[(gemm, gemm)] == pytest.approx({"before": gemm, "after": gemm, "us_per_step": 25.0,
                                                "per_step": 0.5, "us_each": 50.0})
    assert not any("_bounds_kernel" in key for key in rows)  # the pipeline's kernels are not foreground
    assert list(rows)[0] == (gemm, gemm)  # largest first


def test_short_names_and_trace_files(tmp_path):
    assert short_name("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>(x)") == \
        "at::native::reduce_kernel"
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": two_steps()}))
    assert trace_gaps(str(path), steps=2) == foreground_gaps(two_steps(), steps=2)
    assert trace_transfer_idle(str(path), steps=2)["calls"] == 0  # no transfer in these steps
    assert trace_company(str(path), steps=2) == kernel_company(two_steps(), steps=2)


def test_transfer_idle_tells_a_queue_from_a_stream_that_waits_for_its_plan():
    fetch, evict = "_fetch_kernel", "_capped_eviction_kernel"
    events = [kernel(evict, 0, 5, 3), kernel(fetch, 5, 20, 4),  # starts as its plan lands
              kernel(evict, 10, 5, 3), kernel(fetch, 25.5, 20, 4),  # queued behind the first
              kernel(evict, 70, 5, 3), kernel(fetch, 76, 20, 4),  # waited 30 µs, for its plan
              kernel(fetch, 200, 20, 4)]  # waited 104 µs, for something else (a step's start)
    idle = kernel_idle(events, steps=2, kernel=fetch, waits_on=evict)
    assert idle["calls"] == 2 and idle["busy_us"] == pytest.approx(40.0)
    assert (idle["queued_per_step"], idle["waited_per_step"], idle["other_per_step"]) == (0.5, 0.5, 0.5)
    assert idle["idle_queued_us"] == pytest.approx(0.25)
    assert idle["idle_waited_us"] == pytest.approx(15.25)
    assert idle["idle_other_us"] == pytest.approx(52.0)
    assert kernel_idle(events, 1, "_nothing")["calls"] == 0


def test_company_groups_each_launch_by_what_overlaps_it_on_other_streams():
    attn, fetch, bounds = "_decode_split_kernel", "_fetch_kernel", "_bounds_kernel"
    events = [kernel(attn, 0, 40, 7), kernel(fetch, -100, 500, 4),  # beside the fetch only
              kernel(attn, 100, 60, 7), kernel(bounds, 130, 50, 9),  # beside the fetch and a scan
              kernel(attn, 600, 30, 7), kernel("gemm", 630, 10, 7),  # alone (same stream does not count)
              kernel(attn, 700, 40, 7)]  # alone
    rows = {tuple(r["company"]): r for r in kernel_company(events, steps=2)}
    assert rows[()] == {"company": [], "per_step": 1.0, "us_each": 35.0, "overlap_us_each": {}}
    assert rows[(fetch,)]["us_each"] == 40 and rows[(fetch,)]["overlap_us_each"] == {fetch: 40}
    both = rows[(bounds, fetch)]
    assert both["per_step"] == 0.5 and both["overlap_us_each"] == {fetch: 60, bounds: 30}
    assert kernel_company(events, 2)[0]["company"] == []  # most launches first
