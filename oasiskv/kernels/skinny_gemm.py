"""A linear layer for decode batches (a few dozen rows): split-K over a grid of plain programs.

At decode sizes a linear layer reads its weight once and does little else, so its time is the
weight's bytes over the bandwidth the kernel reaches. cuBLASLt's choice for the sparse step's
down projection (48 rows, K 12,288, N 4,096, with the step's SM carve-out) is 64 programs in
clusters of 4, which reach about half the H200's bandwidth and wait for room to start while
the pipeline's stages hold SMs. Here each program takes a tile of BLOCK_N output columns over
a slice of K (split-K, about two programs per SM), writes float32 partial sums, and a second
launch adds the slices (and the bias) in a fixed order, so results do not depend on timing.

Which of the decoder's linears take it is `ENABLED` (names: qkv, o, gate_up, down; empty by
default: an experiment until it wins on the GPU); other shapes and CPU tensors go to torch.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's linear
    triton = None

ENABLED: set[str] = set()
MAX_ROWS = 64  # rows (tokens) at most: one BLOCK_M tile
BLOCK_N, BLOCK_K, STAGES = 64, 128, 4
PROGRAMS_PER_SM = 2


def linear(module: torch.nn.Linear, x: torch.Tensor, name: str) -> torch.Tensor:
    """`module(x)`, through `skinny_linear` where `name` is enabled and the shapes suit it (a plain
    nn.Linear only: a tensor-parallel subclass adds its all-reduce in its own forward)."""
    if name in ENABLED and type(module) is torch.nn.Linear and usable(x, module.weight):
        return skinny_linear(x, module.weight, module.bias)
    return module(x)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (triton is not None and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.dtype == weight.dtype and weight.is_contiguous() and x.stride(1) == 1)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype; M <= MAX_ROWS."""
    M, K = x.shape
    N = weight.shape[0]
    tiles = triton.cdiv(N, BLOCK_N)
    split = split_k(K, tiles, _sm_count(x.device))
    per_split = triton.cdiv(triton.cdiv(K, split), BLOCK_K) * BLOCK_K
    split = triton.cdiv(K, per_split)
    parts = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    bm = max(16, triton.next_power_of_2(M))
    _partial_kernel[(tiles, split)](x, weight, parts, M, N, K, x.stride(0), per_split,
                                    BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_stages=STAGES)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block = 1024
    _sum_kernel[(triton.cdiv(M * N, block),)](parts, out, bias if bias is not None else out, M * N, N,
                                              SPLIT=split, HAS_BIAS=bias is not None, BLOCK=block)
    return out


def split_k(K: int, tiles: int, sms: int) -> int:
    """Slices of K so that tiles x slices is about PROGRAMS_PER_SM programs an SM, each slice at
    least 4 BLOCK_K steps long."""
    want = max(1, (PROGRAMS_PER_SM * sms + tiles - 1) // tiles)
    return max(1, min(want, K // (4 * BLOCK_K)))


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the Triton interpreter (tests): a few slices
    return torch.cuda.get_device_properties(device).multi_processor_count


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


if triton is not None:

    @triton.jit
    def _partial_kernel(x_ptr, w_ptr, part_ptr, M, N, K, stride_xm, per_split,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        tile, s = tl.program_id(0), tl.program_id(1)
        m = tl.arange(0, BLOCK_M)
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        kb = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        start = s * per_split
        for k0 in range(start, start + per_split, BLOCK_K):
            k = k0 + kb
            k_ok = k < K
            xt = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=(n[:, None] < N) & k_ok[None, :],
                         other=0.0)
            acc += tl.dot(xt, tl.trans(wt))
        out = part_ptr + s.to(tl.int64) * M * N + m[:, None] * N + n[None, :]
        tl.store(out, acc, mask=(m[:, None] < M) & (n[None, :] < N))

    @triton.jit
    def _sum_kernel(part_ptr, out_ptr, bias_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < MN
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(SPLIT):
            acc += tl.load(part_ptr + s * MN + i, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)
