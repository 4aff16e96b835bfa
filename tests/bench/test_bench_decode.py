"""`oasiskv bench decode` on CPU at a tiny size (the GPU figures are in docs/benchmarks.md): it
runs dense, sparse, the foreground-only form, the fetch-cap ablation and capacity mode in one
process, and what it reports obeys the cap, the pools and its own arithmetic."""
import argparse
import json

import pytest
import torch

from oasiskv.bench.decode import FETCH_RATIOS, add_decode_args, run_decode_bench
from oasiskv.entrypoints.args import add_engine_args

SMALL = ["--model", "smollm2-135m", "--load-format", "dummy", "--steps", "2", "--warmup", "1",
         "--top-k-blocks", "8", "--host-kv-gb", "0.2", "--kv-cache-gb", "0.2"]


def run_bench(tmp_path, *flags: str) -> dict:
    """`bench decode` at the tiny size with these flags; its JSON."""
    out = tmp_path / "decode.json"
    p = argparse.ArgumentParser()
    add_decode_args(p)
    add_engine_args(p)
    assert run_decode_bench(p.parse_args([*SMALL, *flags, "--output-json", str(out)])) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_bench_decode_runs_every_part_and_respects_the_cap(tmp_path, capsys, async_scheduling):
    res = run_bench(tmp_path, "--context-len", "600", "--batch-size", "2", "--batch-sizes", "2",
                    "--context-lens", "600", "--sweep", "--no-prefetch-run", "--fetch-ablation",
                    "--gpu-kv-gb", "0.05", "--async-scheduling", async_scheduling, "--summary-dtypes", "fp8")
    dense, sparse, fg = res["runs"]
    # The ablation, capacity and foreground-alone runs use the sweep's summaries, not the engine default.
    sparse_runs = [sparse, fg, *res["fetch_ablation"], res["capacity"]["sparse"]]
    assert {r["summary_dtype"] for r in sparse_runs} == {"fp8"}
    assert dense["async_scheduling"] == sparse["async_scheduling"] == (async_scheduling == "on")
    assert (dense["mode"], sparse["mode"], fg["mode"], fg["prefetch"]) == ("dense", "sparse", "sparse", False)
    assert fg["fetched_bytes_per_step"] == 0  # the foreground alone moves nothing
    # smollm2: 30 layers, 3 kv heads, items of 2 x 16 x 64 float32 on CPU
    item, per_cap_unit = 2 * 16 * 64 * 4, 2 * 3 * 30  # batch x heads x layers
    for run in res["fetch_ablation"]:
        assert 0 < run["fetched_bytes_per_step"] <= run["cap"] * per_cap_unit * item
        assert 0 <= run["hit_rate"] <= 1
        assert run["output_tok_s"] > 0 and run["roofline_ms"] > 0
    *fixed, auto = res["fetch_ablation"]
    assert [r["fetch_ratio"] for r in fixed] == list(FETCH_RATIOS) and {r["fetch_budget"] for r in fixed} == {"off"}
    caps = [r["cap"] for r in fixed]
    assert caps == sorted(caps) and caps[-1] == 8  # fetch-all: C = K
    # the auto budget at the default ratio: the nominal CPU budget is far above what the cap moves
    assert auto["fetch_budget"] == "auto" and auto["budget_mb_per_step"] > 0
    assert auto["fetched_bytes_per_step"] == next(r for r in fixed if r["fetch_ratio"] == auto["fetch_ratio"])[
        "fetched_bytes_per_step"]
    cap = res["capacity"]
    assert cap["sparse_max_batch"] == min(cap["sparse_max_batch_gpu"], cap["sparse_max_batch_host"])
    assert cap["sparse_max_batch"] > cap["dense_max_batch"] >= 1
    assert cap["admitted_ratio"] == cap["sparse_max_batch"] / cap["dense_max_batch"]
    s = res["speedups"][0]
    assert s["speedup"] == sparse["output_tok_s"] / dense["output_tok_s"]
    assert f"sparse / dense at batch 2, context 600, async scheduling {async_scheduling}" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_decode_async_modes_side_by_side(tmp_path):
    res = run_bench(tmp_path, "--sweep", "--batch-sizes", "2", "--context-lens", "600", "--async-modes", "off,on")
    assert [(r["mode"], r["async_scheduling"]) for r in res["runs"]] == [
        ("dense", False), ("sparse", False), ("dense", True), ("sparse", True)]
    assert sorted(s["async_scheduling"] for s in res["speedups"]) == [False, True]


@pytest.mark.slow
def test_bench_decode_stage_ablation_and_tuning_flags(tmp_path):
    """--stage-ablation adds a predict-only and a predict + select run; the first admits
    nothing, and neither counts in the speedups. The transfer and bounds-kernel knobs are
    recorded per run; --summary-dtypes runs sparse once per summary dtype (fp8: a quarter of
    float32's summary bytes). --attention-splits, --attention-stages, --stage-forks and
    --transfer-priorities are recorded (CPU attention has none of them; CPU stages run in-line,
    and the CPU transfer is torch indexing)."""
    res = run_bench(tmp_path, "--sweep", "--batch-sizes", "2", "--context-lens", "600", "--stage-ablation",
                    "--transfer-programs", "4:2:4", "--summary-dtypes", "auto,fp8",
                    "--attention-splits", "1", "--attention-stages", "5",
                    "--stage-forks", "o_proj", "--transfer-priorities", "high")
    dense, sparse, fp8, predict, select = res["runs"]
    assert (sparse["summary_dtype"], fp8["summary_dtype"]) == ("auto", "fp8")
    assert fp8["summary_bytes_per_step"] * 4 == sparse["summary_bytes_per_step"] and fp8["admitted_per_step"] > 0
    assert [r.get("pipeline_stages") for r in (sparse, predict, select)] == [3, 1, 2]
    assert sparse["admitted_per_step"] > 0 and predict["admitted_per_step"] == 0
    assert predict["fetched_bytes_per_step"] == 0
    knobs = ("transfer_programs", "transfer_items", "transfer_warps", "attention_splits",
             "attention_stages", "stages_fork", "transfer_priority")
    assert [sparse[k] for k in knobs] == [4, 2, 4, 1, 5, "o_proj", "high"]
    best = max(sparse["output_tok_s"], fp8["output_tok_s"])
    assert [s["speedup"] for s in res["speedups"]] == [best / dense["output_tok_s"]]


@pytest.mark.parametrize("flag,value", [("--transfer-programs", "6:12:24"), ("--transfer-programs", "8:x"),
                                        ("--deferred-layers", "2,-1"), ("--attention-splits", "-2"),
                                        ("--gemm-sm-carveouts", "8,-8"), ("--attention-stages", "0"),
                                        ("--stage-forks", "attention,qkv"),
                                        ("--transfer-priorities", "normal,urgent")])
def test_bench_decode_rejects_bad_knobs_before_loading(tmp_path, flag, value):
    """A malformed tuning value is a clear error at once (24 warps once failed a GPU run after
    the model had loaded)."""
    with pytest.raises(ValueError, match=flag):
        run_bench(tmp_path, flag, value)


@pytest.mark.parametrize("blocks", [1, 64, 65, 130, 1029, 2053, 8200])
def test_bounds_tiling_gives_about_three_programs_per_head(blocks):
    """The pipeline's bounds tiling spreads any context over 3 programs a (request, kv head)
    (fewer when there are fewer tiles)."""
    from oasiskv.sparse.pipeline import BOUNDS_PROGRAMS_PER_HEAD, bounds_tiling

    tile, per_program, _ = bounds_tiling(blocks)
    tiles = -(-blocks // tile)
    programs = -(-tiles // per_program)
    assert programs == min(BOUNDS_PROGRAMS_PER_HEAD, tiles)


def test_bench_decode_attention_knobs_reach_the_decode_kernel(tmp_path, monkeypatch):
    """--attention-splits and --attention-stages arrive at every sparse step's decode call (on
    CPU the torch path ignores them; on CUDA they are the Triton kernel's)."""
    import oasiskv.layers.attention as attention

    seen, real = set(), attention.paged_decode

    def spy(*args):
        seen.add(args[7:9])  # num_splits, num_stages
        return real(*args)

    monkeypatch.setattr(attention, "paged_decode", spy)
    run_bench(tmp_path, "--mode", "sparse", "--context-len", "600", "--batch-size", "2",
              "--attention-splits", "2", "--attention-stages", "5")
    assert seen == {(2, 5)}


def test_bench_decode_sparse_out_of_gpu_memory_is_a_row_that_does_not_fit(tmp_path, monkeypatch):
    """The summaries live beside the GPU KV pool (on the H200, batch 32 at 16K ran out there): a
    sweep reports that row as not fitting and goes on."""
    import oasiskv.sparse.pipeline as pipeline

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(pipeline, "LookaheadPipeline", out_of_memory)
    res = run_bench(tmp_path, "--sweep", "--batch-sizes", "2,1", "--context-lens", "600")
    sparse = [r for r in res["runs"] if r["mode"] == "sparse"]
    assert [r["fits"] for r in sparse] == [False, False]  # the sweep went on past the first
    assert "beside the KV pool" in sparse[0]["why"]
    assert [r["fits"] for r in res["runs"] if r["mode"] == "dense"] == [True, True]


REDUCED_QWEN3 = {"model_type": "qwen3", "vocab_size": 1001, "hidden_size": 256, "intermediate_size": 512,
                 "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
                 "max_position_embeddings": 2048, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}


@pytest.mark.slow
def test_bench_decode_at_tensor_parallel_size_2(tmp_path):
    """Every rank fills and decodes its own shard (a reduced Qwen3 shape: 4 KV heads, 2 a rank);
    the figures are one GPU's: half of size 1's KV bytes, its shard's weights, fetches within
    its heads' cap."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(REDUCED_QWEN3))
    flags = ["--model", str(path), "--context-len", "600", "--batch-size", "2", "--async-scheduling", "on",
             "--host-kv-gb", "0.1", "--kv-cache-gb", "0.05"]
    one, two = run_bench(tmp_path, *flags), run_bench(tmp_path, *flags, "--tensor-parallel-size", "2")
    assert (one["tensor_parallel_size"], two["tensor_parallel_size"]) == (1, 2)
    for a, b in zip(one["runs"], two["runs"]):
        assert a["mode"] == b["mode"] and b["fits"] and b["async_scheduling"]
        assert b["kv_read_bytes_per_step"] == a["kv_read_bytes_per_step"] / 2
        # q, k, v, o, gate, up, down halved; norms whole; the LM head's 501 of 1001 rows
        layer = 256 * (256 + 2 * 128) + 256 * 256 + 3 * 256 * 512
        assert a["weight_bytes"] == 4 * (3 * (layer + 2 * 256 + 2 * 32) + 1001 * 256 + 256)
        assert b["weight_bytes"] == 4 * (3 * (layer // 2 + 2 * 256 + 2 * 32) + 501 * 256 + 256)
    sparse = two["runs"][1]
    item = 2 * 16 * 32 * 4
    assert 0 < sparse["fetched_bytes_per_step"] <= sparse["cap"] * 2 * 2 * 3 * item  # batch x heads x layers
    assert 0 <= sparse["hit_rate"] <= 1


@pytest.mark.slow
def test_bench_decode_fetch_ablation_at_several_batches(tmp_path, capsys):
    """--fetch-ablation-batches: the whole ablation at each batch, in one process, each ending
    with the auto budget's throughput against its fastest fixed ratio."""
    res = run_bench(tmp_path, "--context-len", "600", "--fetch-ablation", "--fetch-ablation-batches", "1,2")
    assert res["runs"] == []
    runs = res["fetch_ablation"]
    n = len(FETCH_RATIOS) + 1
    assert [r["batch"] for r in runs] == [1] * n + [2] * n
    assert [r["fetch_budget"] for r in runs[n - 1::n]] == ["auto", "auto"]
    out = capsys.readouterr().out
    assert out.count("auto budget") == 2 and "fetch-cap ablation, batch 2, context 600" in out


def test_moe_rows_count_the_experts_a_step_routes_to(tmp_path):
    """A MoE model's weight bytes are those of the experts the batch routes to, not all of them."""
    from tiny_qwen3_moe import CONFIG, save_tiny_qwen3_moe

    from oasiskv.models.config import ModelConfig
    from oasiskv.models.step_bytes import weight_bytes_per_step

    save_tiny_qwen3_moe(tmp_path / "moe")
    out = tmp_path / "decode.json"
    p = argparse.ArgumentParser()
    add_decode_args(p)
    add_engine_args(p)
    args = p.parse_args(["--model", str(tmp_path / "moe"), "--steps", "2", "--warmup", "1", "--top-k-blocks", "2",
                         "--host-kv-gb", "0.05", "--kv-cache-gb", "0.05", "--context-len", "64",
                         "--batch-size", "3", "--mode", "dense", "--output-json", str(out)])
    assert run_decode_bench(args) == 0
    (row,) = json.loads(out.read_text())["runs"]
    mc = ModelConfig.from_json(tmp_path / "moe" / "config.json")
    per_layer = row["experts_touched_per_layer"]  # 3 tokens, top 2 of 8, in each of the 3 MoE layers
    assert CONFIG["num_experts_per_tok"] <= per_layer <= 6
    touched = round(per_layer * 3)
    assert row["weight_bytes"] == weight_bytes_per_step(mc, 4, touched)
    every_expert = weight_bytes_per_step(mc, 4)
    assert every_expert - row["weight_bytes"] == (3 * 8 - touched) * 3 * 64 * 32 * 4
