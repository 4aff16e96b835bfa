"""Long prefill chunks through cuDNN's fused attention (Hopper and later), same contract as
`paged_prefill` for the chunks it takes.

A chunk at positions [P, P + L) of its sequence attends its prefix (every query sees every key:
no mask) and itself (causal). cuDNN computes each part with its log-sum-exp, and the two parts
merge as the online softmax would. Keys and values are first gathered out of the pages into one
contiguous buffer per chunk: a memory-bound copy, about 1% of the attention's time at 32K.

On one H200 (Qwen3-8B's heads, bf16) cuDNN is faster where a chunk has many (query, key) pairs
(a 32K prompt in one chunk: 566 against 366 TFLOP/s; 4,096 after 28K: 463 against 378) and
slower at 4,096 after 4K (332 against 375): long chunks come here, the rest stay on the Triton
kernel. cuDNN builds an execution plan for each new shape (66-136 ms, then cached), so only
chunks whose length and offset are multiples of 1,024 tokens come here, which bounds the shapes
a server ever builds (a fresh prompt's full chunks have such offsets). OASISKV_PREFILL_BACKEND=
triton turns the path off, =cudnn sends every chunk to it (checks and benchmarks).
"""
from __future__ import annotations

import functools
import os

import torch

# Chunks whose (query, key) pairs reach this go to cuDNN under the default backend ("auto"):
# a 4,096-token chunk from an 8K offset on, a 7K first chunk.
MIN_PAIRS = 4096 * 12288
SHAPE_STEP = 1024  # cuDNN chunks' length and offset are multiples of this (a bounded plan cache)


def backend() -> str:
    return os.environ.get("OASISKV_PREFILL_BACKEND", "auto")


def cudnn_usable(q: torch.Tensor) -> bool:
    """cuDNN's fused attention runs here: a CUDA tensor on sm90+ with cuDNN, fp16 or bf16."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or backend() == "triton":
        return False
    return _cudnn_attention_on(q.device.index or 0)


@functools.cache
def _cudnn_attention_on(device_index: int) -> bool:
    """cuDNN and an sm90+ device (asked once per device: every layer of every prefill asks)."""
    if not torch.backends.cudnn.is_available() or torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    return hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")


def takes_chunk(prefix: int, length: int) -> bool:
    """Whether a chunk goes to cuDNN (when usable)."""
    if backend() == "cudnn":
        return True
    return prefix % SHAPE_STEP == 0 and length % SHAPE_STEP == 0 and length * (prefix + length) >= MIN_PAIRS


def _attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """q [1, Hq, L, D], k/v [1, Hq, S, D] -> (out [1, Hq, L, D], lse [1, Hq, L, 1] float32)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    return out, lse.reshape(*q.shape[:3], 1)


def chunk_attention(q: torch.Tensor, kv_cache: torch.Tensor, pages: torch.Tensor, prefix: int,
                    num_kv_heads: int, scale: float) -> torch.Tensor:
    """q [L, Hq, D] of one chunk at positions [prefix, prefix + L); pages: [>= ceil((prefix + L) /
    block_size)] page ids of its sequence, on the device -> [L, Hq, D]."""
    L, Hq, D = q.shape
    Hkv, bs = num_kv_heads, kv_cache.shape[2]
    n = prefix + L
    kv = kv_cache.view(-1, Hkv, 2, bs, D)[pages[:(n + bs - 1) // bs].long()]  # [pages, Hkv, 2, bs, D]
    kv = kv.permute(2, 1, 0, 3, 4).reshape(2, Hkv, -1, D)[:, :, :n]
    kv = kv.repeat_interleave(Hq // Hkv, dim=1)[:, None]  # [2, 1, Hq, n, D]: cuDNN's op takes equal heads
    qh = q.transpose(0, 1)[None]
    own, own_lse = _attention_lse(qh, kv[0][..., prefix:, :], kv[1][..., prefix:, :], True, scale)
    if prefix == 0:
        return own[0].transpose(0, 1)
    pre, pre_lse = _attention_lse(qh, kv[0][..., :prefix, :], kv[1][..., :prefix, :], False, scale)
    top = torch.maximum(own_lse, pre_lse)
    w_own, w_pre = torch.exp(own_lse - top), torch.exp(pre_lse - top)
    out = (own.float() * w_own + pre.float() * w_pre) / (w_own + w_pre)
    return out[0].transpose(0, 1).to(q.dtype)
