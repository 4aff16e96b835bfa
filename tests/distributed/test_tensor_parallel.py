"""Tensor parallelism on CPU (Gloo, one process per rank): the same greedy tokens as one rank.

Each engine here starts its ranks once per module. The default model (SmolLM2-135M: 9 query
heads, 3 KV heads) runs at size 3, dense and sparse; a reduced Qwen3-shaped model with random
weights (8 query heads, 4 KV heads) at sizes 2 and 4; a failed rank ends the engine (and the
server) with an error. A tiny Qwen3-MoE's logits at size 2 are here; its engines, in test_qwen3_moe.py.
"""
import argparse
import json
import os
import signal
import threading
import time
from dataclasses import replace

import pytest
import torch
from server_client import call
from tiny_qwen3_moe import save_tiny_qwen3_moe

from oasiskv import LLM, SamplingParams
from oasiskv.config import EngineConfig
from oasiskv.entrypoints.openai.server_process import start_server, stop_server
from oasiskv.distributed.every_rank import run_on_every_rank
from oasiskv.distributed.group import RankFailure, free_port, init_group
from oasiskv.distributed.model import ParallelLlamaForCausalLM
from oasiskv.distributed.sharding import local_config, shard_plan, shard_tensor
from oasiskv.layers.attention import AttentionMetadata, PrefillChunk, prefill_table
from oasiskv.models.config import ModelConfig, preset
from oasiskv.models.llama import LlamaForCausalLM
from oasiskv.models.loader import ModelSource, iter_weights, resolve_model

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
REDUCED_QWEN3 = {"model_type": "qwen3", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                 "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
                 "max_position_embeddings": 2048, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
SPARSE = dict(sparse=True, top_k_blocks=32, sparse_threshold=400, drafter="self", host_kv_gb=0.5)


def _stop(llm):
    if llm.engine.config.tensor_parallel_size > 1:
        llm.engine.runner.shutdown()


# ---- sharding (no processes) ---------------------------------------------------------------

def test_shard_plan_partitions_heads_rows_and_vocab():
    cfg = preset("qwen3-8b")  # 32 query heads, 8 KV heads
    plans = [shard_plan(cfg, r, 4) for r in range(4)]
    assert [p.kv_heads for p in plans] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [p.q_heads for p in plans] == [range(0, 8), range(8, 16), range(16, 24), range(24, 32)]
    assert sum(len(p.vocab) for p in plans) == cfg.vocab_size
    local = local_config(cfg, plans[1])
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (8, 2, 3072)


def test_kv_heads_replicate_beyond_their_count():
    cfg = replace(preset("qwen3-8b"), num_heads=8, num_kv_heads=2, intermediate_size=96)
    plans = [shard_plan(cfg, r, 4) for r in range(4)]
    assert [p.kv_heads for p in plans] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    # query heads 0-3 belong to KV head 0 (group of 4): ranks 0 and 1 hold them
    assert [p.q_heads for p in plans] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="KV heads"):
        shard_plan(replace(cfg, num_heads=12), 0, 3)


def test_shards_rebuild_every_tensor():
    cfg = preset("qwen3-8b")
    plans = [shard_plan(cfg, r, 4) for r in range(4)]
    D, h = cfg.head_dim, 16
    q = torch.randn(cfg.num_heads * D, h)
    assert torch.equal(torch.cat([shard_tensor("model.layers.0.self_attn.q_proj.weight", q, p) for p in plans]), q)
    o = torch.randn(h, cfg.num_heads * D)
    assert torch.equal(torch.cat([shard_tensor("model.layers.0.self_attn.o_proj.weight", o, p) for p in plans], 1), o)
    emb = torch.randn(cfg.vocab_size, h)
    parts = [shard_tensor("model.embed_tokens.weight", emb, p) for p in plans]
    assert all(t.shape[0] == plans[0].vocab_shard for t in parts)
    assert torch.equal(torch.cat(parts)[:cfg.vocab_size], emb)


def test_settings_above_size_1():
    cfg = EngineConfig(tensor_parallel_size=2)
    assert cfg.async_scheduling == "auto"
    for bad in (dict(drafter="oracle"), dict(distributed_timeout_s=0)):
        with pytest.raises(ValueError):
            EngineConfig.from_flat(tensor_parallel_size=2, **bad)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def _prefill_logits(model, cfg, ids):
    """Logits of every position of one prompt, its K/V stored in pages 0, 1, ... of each layer."""
    n, Hkv, bs = len(ids), model.config.num_kv_heads, 16
    pages = list(range((n + bs - 1) // bs))
    kv = [torch.zeros(len(pages) * Hkv, 2, bs, cfg.head_dim) for _ in range(cfg.num_layers)]
    t = torch.arange(n)
    chunks = [PrefillChunk(0, n, 0, pages)]
    meta = AttentionMetadata(write_slots=((t // bs)[:, None] * Hkv + torch.arange(Hkv)).to(torch.int32),
                             write_offsets=(t % bs).to(torch.int32), prefill_chunks=chunks,
                             prefill_table=prefill_table(chunks, torch.device("cpu")))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), kv, meta))


def _reduced_source():
    # vocabulary 1001: the last rank's shard is padded at sizes 2 and 4
    return ModelSource("dummy", replace(ModelConfig.from_hf_dict(REDUCED_QWEN3), vocab_size=1001))


@pytest.mark.parametrize("model, size", [("default", 3), ("reduced", 2), ("reduced", 4), ("moe", 2)])
def test_sharded_model_logits_equal_the_whole_model(model, size, tmp_path):
    """One thread per rank (Gloo): every rank's logits of a 24-token prompt equal the whole
    model's to 1e-4 in float32 (the default model's GGUF weights; the reduced shape's random ones;
    the MoE's, each rank holding half of every expert)."""
    if model == "moe":
        save_tiny_qwen3_moe(tmp_path)
        source = resolve_model(str(tmp_path))
    else:
        source = resolve_model(None) if model == "default" else _reduced_source()
    cfg = source.config
    whole = LlamaForCausalLM(cfg)
    whole.load_weights(iter_weights(source, torch.float32))
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    want = _prefill_logits(whole, cfg, ids)
    port, got = free_port(), [None] * size

    def rank(r):
        group = init_group(r, size, port, torch.device("cpu"), 60)
        model = ParallelLlamaForCausalLM(cfg, shard_plan(cfg, r, size), group)
        model.load_weights(iter_weights(source, torch.float32))
        got[r] = _prefill_logits(model, cfg, ids)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for logits in got:
        assert logits.shape == want.shape
        assert (logits - want).abs().max() < 1e-4


# ---- the default model at size 3 -------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    """Size 1 and size 3, sparse decode on at K = 32 (prompts under 400 tokens decode dense)."""
    one = LLM(max_model_len=1400, **SPARSE)
    three = LLM(max_model_len=1400, tensor_parallel_size=3, distributed_timeout_s=60, **SPARSE)
    yield one, three
    _stop(three)
def test_default_model_size_3_dense_tokens_and_logprobs(smol):
    one, three = smol
    prompts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number."]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    want, got = one.generate(prompts, params), three.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert "sparse_steps" not in g.stats
        # log-softmax of the logits: equal to 1e-4 (float32) at every position, top 5 alike
        diff = max(abs(gl[t] - wl[t]) for wl, gl in zip(w.logprobs, g.logprobs) for t in wl)
        assert diff < 1e-4, diff


def _long_ids(llm, n):
    text = open(argparse.__file__).read()  # real text nobody here wrote: Python's own argparse
    return llm.tokenizer.encode(text, add_special_tokens=False)[:n]
def test_default_model_size_3_sparse(smol):
    """One batch: a 1100-token prompt decoding sparse at K = 32 of its 69 blocks with the `self`
    drafter, a 520-token one whose 33 blocks all fit the 37 working-set pages (full budget), and
    a short one decoding dense with seeded sampling. Each rank selects for its own KV head from
    its own host pool (two extents, placed alike on every rank); rank 0 samples. The tokens are
    size 1's."""
    one, three = smol
    prompts = [_long_ids(one, 1100), _long_ids(one, 520), "Once upon a time"]
    greedy = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    params = [greedy, greedy, SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=13, ignore_eos=True)]
    want, got = one.generate(prompts, params), three.generate(prompts, params)
    assert [o.stats.get("sparse_steps") for o in want] == [12, 12, None]
    assert [o.stats.get("sparse_steps") for o in got] == [12, 12, None]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


# ---- a reduced Qwen3 shape with random weights, at sizes 2 and 4 -----------------------------


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    path = tmp_path_factory.mktemp("reduced_qwen3") / "config.json"
    path.write_text(json.dumps(REDUCED_QWEN3))
    args = dict(load_format="dummy", max_model_len=1024)
    sparse = dict(sparse=True, top_k_blocks=48, sparse_threshold=300, host_kv_gb=0.05, distributed_timeout_s=10)
    engines = {1: LLM(str(path), **args)}
    engines.update({n: LLM(str(path), tensor_parallel_size=n, **args, **sparse) for n in (2, 4)})
    yield engines
    for llm in engines.values():
        _stop(llm)
def test_reduced_qwen3_sizes_2_and_4_dense_and_sparse(reduced):
    """Dense prompts, and a 600-token prompt that decodes sparse at sizes 2 and 4 with every block
    resident: size 1's dense tokens throughout."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (7, 40, 600)]
    want = [o.token_ids for o in reduced[1].generate(prompts, GREEDY)]
    for n in (2, 4):
        got = reduced[n].generate(prompts, GREEDY)
        assert [o.token_ids for o in got] == want, n
        assert got[2].stats["sparse_steps"] == 15 and "sparse_steps" not in got[0].stats


def test_reduced_qwen3_sizes_2_and_4_async_dense(reduced):
    """Dense steps launched before the last one's tokens are read, at sizes 2 and 4: every
    rank's inputs are rank 0's samples, broadcast on the device; a greedy and a seeded sampled
    request give size 1's (synchronous) tokens, and a third ends on a stop token while its next
    step runs."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (9, 50, 30)]
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=16, ignore_eos=True),
              replace(GREEDY, max_tokens=16)]
    params[2].stop_token_ids = [reduced[1].generate(prompts[2], GREEDY)[0].token_ids[6]]
    want = [o.token_ids for o in reduced[1].generate(prompts, params)]
    assert len(want[2]) < 16
    for n in (2, 4):
        engine = reduced[n].engine
        before = engine.step_stats["overlapped_steps"]
        engine.async_scheduling = True  # the engine reads it each step (auto is off on CPU)
        try:
            assert [o.token_ids for o in reduced[n].generate(prompts, params)] == want, n
        finally:
            engine.async_scheduling = False
        assert engine.step_stats["overlapped_steps"] - before >= 10
def test_reduced_qwen3_size_2_preempted_requests(reduced, tmp_path):
    """Ten pages for four requests of four pages each: rank 0's scheduler preempts, the other
    rank's mirror drops the pages and recomputes with it; the tokens are size 1's."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(REDUCED_QWEN3))
    page_bytes = 3 * 2 * 2 * 16 * 32 * 4  # layers x (K, V) x KV heads per rank x block x head dim x fp32
    llm = LLM(str(path), load_format="dummy", max_model_len=1024, tensor_parallel_size=2,
              kv_cache_gb=10 * page_bytes / 2**30, distributed_timeout_s=10)
    try:
        gen = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 1000, (40,), generator=gen).tolist() for _ in range(4)]
        want = [o.token_ids for o in reduced[1].generate(prompts, GREEDY)]
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        _stop(llm)
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_reduced_qwen3_size_2_sparse_pipeline(tmp_path, async_scheduling):
    """The batched pipeline on each rank (its torch stages on CPU), K = 8 blocks, so rows evict
    and fetch. After the same step the first request finishes (the last row moves into its
    row) and the third converts (it takes the next row): the other rank replays both in rank
    0's order, so every row holds the same request on both ranks. The second request ends on a
    stop token (under async scheduling while its next step runs: its row moves then). Size 1's
    tokens (synchronous), also when the steps of sparse rows overlap (async: each step's inputs
    are rank 0's samples of the step before, broadcast on the device)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(REDUCED_QWEN3))
    args = dict(load_format="dummy", max_model_len=1024, sparse=True, top_k_blocks=8,
                window_blocks=2, sink_blocks=1, sparse_threshold=256, fetch_ratio=0.25, host_kv_gb=0.05)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (400, 330, 250)]
    # the third converts after the step that gives its 7th token, when the first ends
    params = [replace(GREEDY, max_tokens=n) for n in (7, 28, 20)]
    one = LLM(str(path), **args)
    params[1].stop_token_ids = [one.generate(prompts[1], params[1])[0].token_ids[20]]
    want = one.generate(prompts, params)
    two = LLM(str(path), tensor_parallel_size=2, distributed_timeout_s=30, async_scheduling=async_scheduling,
              **args)
    try:
        leaves, changes = [], two.engine.runner.steps.record_leave
        two.engine.runner.steps.record_leave = lambda seq: (leaves.append(seq.request_id), changes(seq))
        got = two.generate(prompts, params)
        assert two.engine.runner.pipeline.num_rows == 0 and len(leaves) == 3
        assert (two.engine.step_stats["overlapped_steps"] > 10) == (async_scheduling == "on")
    finally:
        _stop(two)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.stats["sparse_steps"] for o in got] == [o.stats["sparse_steps"] for o in want]
    assert want[1].stats["evicted"] > 0 and got[1].stats["evicted"] > 0
    assert want[1].finish_reason == "stop" and len(want[1].token_ids) < 28
def test_a_hung_rank_ends_the_engine_within_the_timeout(reduced):
    llm = reduced[4]
    os.kill(llm.engine.runner.ranks.procs[2].pid, signal.SIGSTOP)  # rank 3 stops answering
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="timeout 10 s"):
        llm.generate([1, 2, 3], GREEDY)
    assert 9 < time.monotonic() - t0 < 40


def test_a_killed_rank_ends_the_engine_with_an_error(reduced):
    llm = reduced[2]
    proc = llm.engine.runner.ranks.procs[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 exited with code -9"):
        llm.generate([1, 2, 3], GREEDY)
    assert time.monotonic() - t0 < 10


def _sum_of_ranks(group) -> int:
    return int(group.all_reduce(torch.tensor([group.rank])).item())


def _fail_on_rank_1(group) -> None:
    if group.rank == 1:
        raise ValueError("rank 1 fails here")
    group.all_reduce(torch.zeros(1))  # rank 0 waits for a rank that is gone
def test_a_function_on_every_rank():
    """`bench decode`'s launcher (`run_on_every_rank`): rank 0 returns its result, and a rank
    that raises ends it with a RankFailure carrying that rank's error."""
    cfg = EngineConfig(tensor_parallel_size=2, distributed_timeout_s=10, device="cpu")
    assert run_on_every_rank(cfg, _sum_of_ranks) == 1
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 raised:(.|\n)*rank 1 fails here"):
        run_on_every_rank(cfg, _fail_on_rank_1)
    assert time.monotonic() - t0 < 30


def _spawned_ranks(pid: int) -> list[int]:
    """Process ids of the ranks `pid` spawned (multiprocessing's resource tracker left out)."""
    ranks = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and "spawn_main" in cmd:
            ranks.append(int(d))
    return ranks
def test_server_ends_when_a_rank_dies(tmp_path):
    """`oasiskv serve -tp 2`: a killed rank fails the next request with 503, and the server exits
    with status 1 (an engine fault, docs/serving.md)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(REDUCED_QWEN3))
    port = free_port()
    proc = start_server([str(path), "--load-format", "dummy", "--max-model-len", "512", "-tp", "2",
                         "--distributed-timeout-s", "10"], "127.0.0.1", port, timeout=300)
    base = f"http://127.0.0.1:{port}"
    body = {"model": str(path), "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
    try:
        assert call(base, "/v1/completions", body)[0] == 200
        (rank,) = _spawned_ranks(proc.pid)
        os.kill(rank, signal.SIGKILL)
        status, _ = call(base, "/v1/completions", body)
        assert status == 503
        assert proc.wait(60) == 1
    finally:
        stop_server(proc)
