"""The cuDNN prefill path's own work (kernels/cudnn_prefill.py): gathering a chunk's keys out of
the pages, attending its prefix and itself apart, and merging the two by log-sum-exp; and the
dispatch that sends long chunks there and the rest, as a sub-table, to the Triton kernel. cuDNN
itself needs a GPU (scripts/gpu_prefill_kernel.py checks it there): here a float32 torch
attention that returns the same (out, lse) stands in for it."""
from __future__ import annotations

import pytest
import torch

from oasiskv.kernels import cudnn_prefill, paged_prefill as prefill_module
from oasiskv.kernels.reference import paged_prefill_ref, random_paged_prefill


def attention_lse(q, k, v, causal, scale):
    """cuDNN's contract in float32 math: q [1, H, L, D], k/v [1, H, S, D]; causal aligns the
    diagonal at the top left (L == S where it is used). Unequal heads raise, as a cuDNN without
    GQA would."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype), lse


def attention_lse_gqa(q, k, v, causal, scale):
    """The same with GQA: kv head h // G serves query head h."""
    G = q.shape[1] // k.shape[1]
    return attention_lse(q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), causal, scale)


@pytest.fixture
def fake_cudnn(monkeypatch):
    monkeypatch.setattr(cudnn_prefill, "_attention_lse", attention_lse)
    monkeypatch.setattr(cudnn_prefill, "_GQA_NATIVE", {})


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("own", ["pages", "given"])
@pytest.mark.parametrize("prefix,length,G", [(0, 37, 3), (16, 16, 4), (45, 30, 7), (160, 5, 1)])
def test_chunk_attention_matches_reference(fake_cudnn, monkeypatch, prefix, length, G, own, gqa):
    """own: the chunk's own keys read back from the pages, or given as the layer computed them
    (v a strided view, as qkv_epilogue returns it); gqa: cuDNN takes fewer kv heads, or not
    (then they are repeated)."""
    if gqa:
        monkeypatch.setattr(cudnn_prefill, "_attention_lse", attention_lse_gqa)
    q, cache, table, _ = random_paged_prefill([(prefix, length)], 2, G, 32, torch.float32, seed=length)
    ref = paged_prefill_ref(q, cache, table.chunks, table.page_table, 2, 0.2)
    own_kv = None
    if own == "given":
        k, v = cudnn_prefill.gather_keys(cache, table.page_table[0], prefix + length, 2)[:, :, prefix:]
        fused = torch.zeros(length, 2, 3, 32)  # v inside a wider row, as in the fused projection
        fused[:, :, 1] = v.transpose(0, 1)
        own_kv = (k.transpose(0, 1).contiguous(), fused[:, :, 1])
    out = cudnn_prefill.chunk_attention(q, cache, table.page_table[0], prefix, 2, 0.2, own_kv=own_kv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert cudnn_prefill._GQA_NATIVE.get("cpu", gqa) == gqa  # asked once (G = 1 never asks)


def test_gather_keys_reads_positions_in_order():
    """[2, Hkv, n, D] of the first n positions, from scattered pages (NaN past them)."""
    q, cache, table, pages = random_paged_prefill([(20, 9)], 2, 1, 8, torch.float32, seed=3)
    kv = cudnn_prefill.gather_keys(cache, table.page_table[0], 29, 2)
    assert kv.shape == (2, 2, 29, 8) and not kv.isnan().any()
    slot = pages[0][27 // 16] * 2 + 1  # position 27, kv head 1
    assert torch.equal(kv[0, 1, 27], cache[slot, 0, 27 % 16]) and torch.equal(kv[1, 1, 27], cache[slot, 1, 27 % 16])


def test_long_chunks_go_to_cudnn_the_rest_to_the_kernel(fake_cudnn, monkeypatch):
    spans = [(0, 40), (64, 8), (100, 50), (3, 2)]  # pairs: 1600, 576, 7500, 10
    q, cache, table, _ = random_paged_prefill(spans, 2, 3, 32, torch.float32, seed=7)
    ref = paged_prefill_ref(q, cache, table.chunks, table.page_table, 2, 0.25)
    seen = {}

    def kernel(q, cache, sub, hkv, scale, out):
        seen["spans"] = sub.spans
        part = prefill_module.paged_prefill_torch(q, cache, sub, hkv, scale)
        for start, n, _ in sub.spans:
            out[start:start + n] = part[start:start + n]
        return out

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the GPU branch of the dispatch
    monkeypatch.setattr(cudnn_prefill, "cudnn_usable", lambda q: True)
    monkeypatch.setattr(cudnn_prefill, "MIN_PAIRS", 1000)
    monkeypatch.setattr(cudnn_prefill, "SHAPE_STEP", 1)
    monkeypatch.setattr(prefill_module, "paged_prefill_triton", kernel)
    out = prefill_module.paged_prefill(q, cache, table, 2, 0.25)
    assert [n for _, n, _ in seen["spans"]] == [8, 2]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_one_long_chunk_takes_its_own_keys_as_given(fake_cudnn, monkeypatch):
    """A step of one chunk: cuDNN's output is the step's, and the own keys are k, v as given
    (here zeros where the pages hold the real ones: the output must follow k, v)."""
    q, cache, table, _ = random_paged_prefill([(0, 40)], 2, 3, 32, torch.float32, seed=5)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(cudnn_prefill, "cudnn_usable", lambda q: True)
    monkeypatch.setattr(cudnn_prefill, "MIN_PAIRS", 1000)
    monkeypatch.setattr(cudnn_prefill, "SHAPE_STEP", 1)
    k, v = cudnn_prefill.gather_keys(cache, table.page_table[0], 40, 2).transpose(1, 2)  # [40, 2, 32] each
    ref = prefill_module.paged_prefill(q, cache, table, 2, 0.25)
    torch.testing.assert_close(prefill_module.paged_prefill(q, cache, table, 2, 0.25, k, v), ref)
    zeros = prefill_module.paged_prefill(q, cache, table, 2, 0.25, k, torch.zeros_like(v))
    assert torch.equal(zeros, torch.zeros_like(zeros))


def test_only_long_chunks_at_round_offsets_take_cudnn(monkeypatch):
    monkeypatch.delenv("OASISKV_PREFILL_BACKEND", raising=False)
    assert cudnn_prefill.takes_chunk(0, 32768) and cudnn_prefill.takes_chunk(28672, 4096)
    assert not cudnn_prefill.takes_chunk(4096, 4096)  # few pairs: the Triton kernel is faster
    assert not cudnn_prefill.takes_chunk(28673, 4096) and not cudnn_prefill.takes_chunk(28672, 4000)
    monkeypatch.setenv("OASISKV_PREFILL_BACKEND", "cudnn")
    assert cudnn_prefill.takes_chunk(3, 5)


def test_warm_up_builds_the_full_chunks_of_long_prompts(monkeypatch):
    monkeypatch.delenv("OASISKV_PREFILL_BACKEND", raising=False)
    assert cudnn_prefill.warm_up_offsets(4096, 32768) == [8192, 12288, 16384, 20480, 24576, 28672]
    assert cudnn_prefill.warm_up_offsets(32768, 32768) == [0]
    assert cudnn_prefill.warm_up_offsets(2048, 8192) == []  # no chunk of an 8K prompt is long enough
    assert cudnn_prefill.warm_up_offsets(1000, 32768) == []  # not a round size: never sent to cuDNN
