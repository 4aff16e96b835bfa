"""Qwen3-MoE: a tiny random model saved by HF transformers loads from its directory and decodes
HF's logits and greedy tokens, dense and sparse at a full budget, and at tensor-parallel size 2;
the 30B-A3B and 235B-A22B presets hold the published shapes and build (on the meta device, and
shrunken with dummy weights)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from tiny_qwen3_moe import VOCAB, save_tiny_qwen3_moe

from oasiskv import LLM, SamplingParams
from oasiskv.bench.roofline import prefill_flops
from oasiskv.distributed.layers import ParallelMoeMLP
from oasiskv.distributed.sharding import local_config, shard_plan, shard_tensor
from oasiskv.layers.moe import MoeMLP
from oasiskv.models.config import preset
from oasiskv.models.llama import LlamaForCausalLM, LlamaMLP
from oasiskv.models.loader import hf_weight_shapes, iter_weights, resolve_model

STEPS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS + 1, ignore_eos=True)  # prefill + 32 decode steps
# K = 32 blocks hold the whole 200-token prompt and its 33 tokens; it converts after its prefill.
SPARSE = dict(sparse=True, top_k_blocks=32, sparse_threshold=96, host_kv_gb=0.01)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, HF model, a 200-token prompt, HF's logits of the prompt's last position and
    of each of its 32 greedy tokens, those tokens)."""
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    hf = save_tiny_qwen3_moe(path)
    ids = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        prompt = torch.tensor([ids])  # the mask is explicit: a pad id would mask its tokens in the prompt
        full = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=STEPS + 1,
                           do_sample=False, pad_token_id=0)[0]
        logits = hf(full[None, :-1]).logits[0, len(ids) - 1:]
    return path, hf, ids, logits, full[len(ids):].tolist()


def _sampled_logits(llm, prompt):
    """Generates greedily, keeping the logits of the row each step samples from (row 0: one
    request, and a sparse step's token row comes before its draft row)."""
    model, seen = llm.engine.runner.model, []
    original = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(original(hidden)[0].clone()) or original(hidden)
    try:
        out = llm.generate(prompt, GREEDY)[0]
    finally:
        model.compute_logits = original
    return out, torch.stack(seen)


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [False, True])
def test_logits_and_greedy_tokens_equal_hf(tiny, sparse):
    path, _, ids, want_logits, want_tokens = tiny
    llm = LLM(str(path), max_model_len=512, **(SPARSE if sparse else {}))
    assert llm.engine.runner.model_config.num_experts == 8
    out, logits = _sampled_logits(llm, ids)
    assert out.token_ids == want_tokens
    assert logits.shape == want_logits.shape  # the prefill's row and 32 decode steps
    assert (logits - want_logits).abs().max() < 1e-4
    assert out.stats.get("sparse_steps") == (STEPS if sparse else None)


def test_layers_follow_the_config(tiny):
    path = tiny[0]
    model = LLM(str(path), max_model_len=512).engine.runner.model
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [MoeMLP, LlamaMLP, MoeMLP, MoeMLP]  # mlp_only_layers = [1]
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)


@pytest.mark.slow
def test_tensor_parallel_size_2_equals_size_1(tiny):
    """Each rank holds half of every expert's rows and the whole router: a dense batch of two and
    the sparse prompt give size 1's tokens."""
    path, _, ids, _, want_sparse = tiny
    gen = torch.Generator().manual_seed(1)
    short = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), max_model_len=512).generate(short, params)]
    two = LLM(str(path), max_model_len=512, tensor_parallel_size=2, distributed_timeout_s=30, **SPARSE)
    try:
        moe = two.engine.runner.model.model.layers[0].mlp
        assert isinstance(moe, ParallelMoeMLP) and moe.experts.gate_up_proj.shape == (8, 32, 64)  # 2 x 16 rows
        got = two.generate(short + [ids], [params, params, GREEDY])
    finally:
        two.engine.runner.shutdown()
    assert [o.token_ids for o in got] == want + [want_sparse]
    assert got[2].stats["sparse_steps"] == STEPS


def test_experts_split_by_intermediate_rows():
    """qwen3-30b-a3b over 4 ranks: each holds 192 of every expert's 768 rows; the router whole."""
    cfg = preset("qwen3-30b-a3b")
    plans = [shard_plan(cfg, r, 4) for r in range(4)]
    assert [p.expert_intermediate for p in plans] == [range(r * 192, (r + 1) * 192) for r in range(4)]
    assert local_config(cfg, plans[1]).moe_intermediate_size == 192
    up, down, router = torch.randn(768, 8), torch.randn(8, 768), torch.randn(128, 8)
    layer = "model.layers.3.mlp."
    assert torch.equal(torch.cat([shard_tensor(layer + "experts.5.up_proj.weight", up, p) for p in plans]), up)
    assert torch.equal(torch.cat([shard_tensor(layer + "experts.5.down_proj.weight", down, p) for p in plans], 1),
                       down)
    assert all(shard_tensor(layer + "gate.weight", router, p) is router for p in plans)


# ---- presets -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, shape, params, active", [
    # (layers, hidden, query heads, KV heads, head dim, experts, top-k, expert width, vocab, context)
    ("qwen3-30b-a3b", (48, 2048, 32, 4, 128, 128, 8, 768, 151936, 40960), 30.5e9, 3.3e9),
    ("qwen3-235b-a22b", (94, 4096, 64, 4, 128, 128, 8, 1536, 151936, 40960), 235e9, 22e9),
])
def test_presets_hold_the_published_shapes(name, shape, params, active):
    cfg = resolve_model(name, "dummy").config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_experts,
            cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.vocab_size,
            cfg.max_position_embeddings) == shape
    assert cfg.qk_norm and cfg.norm_topk_prob and cfg.rope_theta == 1e6 and not cfg.tie_word_embeddings
    assert all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert abs(cfg.num_params() / params - 1) < 0.005
    assert abs(cfg.num_params(active=True) / active - 1) < 0.02
    # Per layer: attention q, k, v, o; 128 experts of gate, up, down; the router; two norms, q/k norms.
    h, q, kv, e = cfg.hidden_size, cfg.num_heads * 128, cfg.num_kv_heads * 128, cfg.moe_intermediate_size
    layer = h * (q + 2 * kv) + q * h + 128 * 3 * h * e + 128 * h + 2 * h + 2 * 128
    assert cfg.num_params() == cfg.num_layers * layer + 2 * cfg.vocab_size * h + h
    # A prefill token multiplies the active weights but the embedding's, twice (multiply, add).
    linear, _ = prefill_flops(cfg, 1000)
    assert abs(linear / 1000 / 2 / (cfg.num_params(active=True) - 2 * cfg.vocab_size * h) - 1) < 1e-3


def test_30b_a3b_builds_on_the_meta_device():
    """`LLM("qwen3-30b-a3b", load_format="dummy")`'s model, without memory: every dummy tensor
    lands in a parameter of its shape, and the parameters add up to the preset's count."""
    source = resolve_model("qwen3-30b-a3b", "dummy")
    with torch.device("meta"):
        model = LlamaForCausalLM(source.config)
    model.load_weights(iter_weights(source, torch.bfloat16, device="meta"))
    assert sum(p.numel() for p in model.parameters()) == source.config.num_params()
    assert model.model.layers[47].mlp.experts.down_proj.shape == (128, 2048, 768)


@pytest.mark.slow
def test_shrunken_30b_a3b_runs_with_dummy_weights(tmp_path):
    """The preset at two layers and a small width, written as an HF config.json: it reads back
    as the same config, and an engine with dummy weights of its shapes generates."""
    cfg = replace(preset("qwen3-30b-a3b"), vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, num_experts=16, moe_intermediate_size=32)
    hf = {"model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16,
          "moe_intermediate_size": 32, "intermediate_size": cfg.intermediate_size,
          "num_experts_per_tok": cfg.num_experts_per_tok, "norm_topk_prob": True, "decoder_sparse_step": 1,
          "mlp_only_layers": [], "max_position_embeddings": cfg.max_position_embeddings,
          "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": False,
          "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    source = resolve_model(str(tmp_path / "config.json"), "dummy")
    assert replace(source.config, name=cfg.name) == cfg
    assert sum(torch.Size(s).numel() for s in hf_weight_shapes(cfg).values()) == cfg.num_params()
    out = LLM(str(tmp_path / "config.json"), load_format="dummy", max_model_len=256).generate(
        list(range(1, 30)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


@pytest.mark.slow
def test_eval_passkey_runs_and_sparse_at_a_full_budget_answers_as_dense(tiny, tmp_path):
    """The accuracy plumbing on a MoE model: random weights answer nonsense, but the sparse run
    (K = 64 blocks hold the whole 400-token prompt) answers the dense run's nonsense."""
    from oasiskv.entrypoints.cli import main as cli_main

    out = tmp_path / "pk.json"
    assert cli_main(["eval", "passkey", "--model", str(tiny[0]), "--context-len", "400", "--depths", "0.3", "0.7",
                     "--seeds", "0", "--drafters", "self", "--sparse-threshold", "128", "--top-k-blocks", "64",
                     "--output-json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    answers = {name: [c["answer"] for c in run["per_case"]] for name, run in runs.items()}
    assert len(answers["dense"]) == 2 and answers["self"] == answers["dense"]
