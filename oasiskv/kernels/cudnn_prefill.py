"""Long prefill chunks through cuDNN's fused attention (Hopper and later), same contract as
`paged_prefill` for the chunks it takes.

A chunk at positions [P, P + L) of its sequence attends its prefix (every query sees every key:
no mask) and itself (causal). cuDNN computes each part with its log-sum-exp, and the two parts
merge as the online softmax would. The chunk's own keys and values come as the layer computed
them; the prefix's are gathered out of the pages into one contiguous buffer (one copy); the
merge is one pass (`merge_attention`).

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

from oasiskv.kernels.merge_attention import merge_parts

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


# Per device: does cuDNN take keys and values with fewer heads than the query (GQA) and give
# what the repeated heads give? Asked once, on a small case (`_gqa_native`).
_GQA_NATIVE: dict[str, bool] = {}


def _gqa_native(q: torch.Tensor) -> bool:
    key = str(q.device)
    if key not in _GQA_NATIVE:
        gen = torch.Generator(device=q.device).manual_seed(0)
        qs = torch.randn(1, 4, 64, q.shape[-1], device=q.device, generator=gen).to(q.dtype)
        ks, vs = (torch.randn(1, 2, 64, q.shape[-1], device=q.device, generator=gen).to(q.dtype) for _ in range(2))
        try:
            got = _attention_lse(qs, ks, vs, True, 0.1)[0]
            ok = torch.allclose(got.float(), _attention_lse(qs, ks.repeat_interleave(2, dim=1),
                                                            vs.repeat_interleave(2, dim=1), True, 0.1)[0].float(),
                                atol=1e-2, rtol=1e-2)
        except RuntimeError:
            ok = False
        _GQA_NATIVE[key] = ok
    return _GQA_NATIVE[key]


def gather_keys(kv_cache: torch.Tensor, pages: torch.Tensor, n: int, num_kv_heads: int) -> torch.Tensor:
    """The first n positions' K and V of a sequence out of its pages: [2, Hkv, n, D], one copy."""
    Hkv, bs, D = num_kv_heads, kv_cache.shape[2], kv_cache.shape[3]
    by_page = kv_cache.view(-1, Hkv, 2, bs, D).permute(2, 1, 0, 3, 4)  # [2, Hkv, pages, bs, D], a view
    kv = torch.index_select(by_page, 2, pages[:(n + bs - 1) // bs].long())
    return kv.reshape(2, Hkv, -1, D)[:, :, :n]


def chunk_attention(q: torch.Tensor, kv_cache: torch.Tensor, pages: torch.Tensor, prefix: int,
                    num_kv_heads: int, scale: float, own_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> torch.Tensor:
    """q [L, Hq, D] of one chunk at positions [prefix, prefix + L); pages: [>= ceil((prefix + L) /
    block_size)] page ids of its sequence, on the device; own_kv: the chunk's own K and V [L, Hkv,
    D] as the layer computed them (what it stored in the pages; read from the pages if None)
    -> [L, Hq, D]."""
    L, Hq, D = q.shape
    Hkv = num_kv_heads
    G = Hq // Hkv
    qh = q.transpose(0, 1)  # [Hq, L, D]; head h reads kv head h // G
    if own_kv is None:
        own_k, own_v = gather_keys(kv_cache, pages, prefix + L, Hkv)[:, :, prefix:]
    else:
        own_k, own_v = (t.transpose(0, 1) for t in own_kv)  # [Hkv, L, D] views
    if G > 1 and not _gqa_native(q):  # cuDNN's causal op then takes equal heads
        own_k, own_v = own_k.repeat_interleave(G, dim=0), own_v.repeat_interleave(G, dim=0)
    own, own_lse = _attention_lse(qh[None], own_k[None], own_v[None], True, scale)
    if prefix == 0:
        return own[0].transpose(0, 1)
    kv = gather_keys(kv_cache, pages, prefix, Hkv)
    # Without a mask a kv head's G query heads are one longer query: no copy of the prefix's keys.
    pre, pre_lse = _attention_lse(qh.reshape(1, Hkv, G * L, D), kv[0][None], kv[1][None], False, scale)
    return merge_parts(own[0], own_lse[0, ..., 0], pre.view(Hq, L, D), pre_lse.view(Hq, L), q.dtype)


def warm_up_offsets(chunk: int, max_len: int) -> list[int]:
    """The offsets of a long prompt's full `chunk`-token chunks that cuDNN takes."""
    if chunk % SHAPE_STEP:
        return []
    return [p for p in range(0, max_len - chunk + 1, chunk) if takes_chunk(p, chunk)]


def warm_up(kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int, chunk: int, max_len: int,
            scale: float) -> int:
    """Builds cuDNN's plans for the chunks a server's long prompts will bring: `chunk` tokens at
    each offset k x `chunk` below `max_len` that cuDNN takes (a plan is 66-136 ms the first time,
    which would otherwise land on a request's TTFT). Reads a layer's pool `kv_cache` as the
    keys (whatever it holds; nothing is written). Returns the number of shapes run."""
    if backend() != "auto" or not kv_cache.is_cuda:
        return 0
    D, bs = kv_cache.shape[-1], kv_cache.shape[2]
    q = torch.zeros(chunk, num_heads, D, dtype=kv_cache.dtype, device=kv_cache.device)
    pages = kv_cache.shape[0] // num_kv_heads
    prefixes = [p for p in warm_up_offsets(chunk, max_len) if p + chunk <= pages * bs]
    if not prefixes or not cudnn_usable(q):
        return 0
    table = torch.arange(pages, device=kv_cache.device, dtype=torch.int32)
    # The own keys and values with the strides a layer gives them (qkv_epilogue: k its own
    # tensor, v a view of the fused projection), which cuDNN's plans are built for.
    k = torch.zeros(chunk, num_kv_heads, D, dtype=q.dtype, device=q.device)
    v = torch.zeros(chunk, (num_heads + 2 * num_kv_heads) * D, dtype=q.dtype, device=q.device)
    v = v[:, (num_heads + num_kv_heads) * D:].view(chunk, num_kv_heads, D)
    for p in prefixes:
        chunk_attention(q, kv_cache, table, p, num_kv_heads, scale, own_kv=(k, v))
    torch.cuda.synchronize(kv_cache.device)
    return len(prefixes)
