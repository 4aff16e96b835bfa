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
    diagonal at the top left (L == S where it is used)."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype), lse


@pytest.fixture
def fake_cudnn(monkeypatch):
    monkeypatch.setattr(cudnn_prefill, "_attention_lse", attention_lse)


@pytest.mark.parametrize("prefix,length,G", [(0, 37, 3), (16, 16, 4), (45, 30, 7), (160, 5, 1)])
def test_chunk_attention_matches_reference(fake_cudnn, prefix, length, G):
    q, cache, table, _ = random_paged_prefill([(prefix, length)], 2, G, 32, torch.float32, seed=length)
    ref = paged_prefill_ref(q, cache, table.chunks, table.page_table, 2, 0.2)
    out = cudnn_prefill.chunk_attention(q, cache, table.page_table[0], prefix, 2, 0.2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


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
