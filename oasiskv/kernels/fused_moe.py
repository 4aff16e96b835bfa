"""A mixture-of-experts SwiGLU layer: the router's top k, then grouped GEMMs over rows sorted by
expert.

Each (token, choice) of the router's top-k is a row. The rows are sorted by expert and each
expert's rows padded to a multiple of BLOCK_M, so the BLOCK_M rows of one program share one
expert; an expert with no tokens gets no programs. Decode-sized batches take three launches: one
program routes and groups (softmax, top k, the sort, `_route_group_kernel`), then one grouped
GEMM stores silu(gate) * up and one multiplies that by the expert's down weight, scaled by the
routing weight. Prefill-sized batches (many rows an expert) multiply by the stacked gate and up
rows as one GEMM, apply silu(gate) * up apart, and group in torch. The k rows of a token are
summed last. Launch sizes depend on shapes only (the grouping is read on the device), so a
decode step can be captured in a CUDA graph. `fused_moe_ref` (kernels/reference.py) is the
semantics; CPU runs it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from oasiskv.kernels.reference import fused_moe_ref, route_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the reference alone
    triton = None

FUSED_ROUTING_MAX_TILE = 16384  # tokens x experts (powers of 2) the one routing program holds at once


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, router_logits: torch.Tensor,
              top_k: int, renormalize: bool) -> torch.Tensor:
    """The layer from the router's logits [T, E]: Triton on CUDA, the torch reference elsewhere."""
    if x.is_cuda:
        return fused_moe_routed(x, w_gate_up, w_down, router_logits, top_k, renormalize)
    return fused_moe_ref(x, w_gate_up, w_down, *route_ref(router_logits, top_k, renormalize))


@dataclass(frozen=True, slots=True)
class ExpertBlocks:
    """Rows in expert order, padded per expert to whole blocks of `block_m`."""
    rows: torch.Tensor  # [num_blocks * block_m] int32: row (token * k + choice), or T * k for padding
    experts: torch.Tensor  # [num_blocks] int32: each block's expert, -1 for blocks past the last
    block_m: int


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort the rows of `topk_ids` [T, k] by expert, without a host sync: the number of blocks
    is its bound for T * k rows (each expert that has rows adds at most one partial block)."""
    dev = topk_ids.device
    expert = topk_ids.reshape(-1).long()
    n = expert.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, expert, torch.ones_like(expert))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.sort(expert, stable=True).indices  # rows in expert order
    sorted_expert = expert[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_expert]  # place within its expert
    num_blocks = n // block_m + min(n, num_experts)
    rows = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=dev)
    rows[(padded_end - padded)[sorted_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=dev) * block_m
    experts = torch.searchsorted(padded_end, starts, right=True)
    experts = torch.where(experts < num_experts, experts, -1).to(torch.int32)
    return ExpertBlocks(rows, experts, block_m)


@dataclass(frozen=True, slots=True)
class MoeTiling:
    """One launch's tile: rows a program takes (block_m), output columns (block_n), the reduction
    step (block_k), Triton's warps and pipeline stages, and whether gate and up run as one GEMM
    with silu(gate) * up apart (faster with many rows an expert) or fused in one kernel."""
    block_m: int
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    split_gate_up: bool = False


def choose_tiling(num_rows: int, num_experts: int) -> MoeTiling:
    """Tiles measured best at Qwen3-30B-A3B's shapes on an H100 (scripts/gpu_check_fused_moe.py):
    few rows stream the weights (narrow columns, long reductions); many rows are GEMMs."""
    per_expert = num_rows // num_experts
    if num_rows < 64:
        return MoeTiling(16, block_n=32, block_k=64)
    if per_expert < 16:
        return MoeTiling(16, block_n=64, block_k=128, num_stages=4)
    if per_expert < 128:
        return MoeTiling(min(64, triton.next_power_of_2(per_expert)))
    return MoeTiling(128, block_n=128, block_k=64, num_warps=8, num_stages=4, split_gate_up=True)


def fused_moe_routed(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, router_logits: torch.Tensor,
                     top_k: int, renormalize: bool, tiling: MoeTiling | None = None) -> torch.Tensor:
    """Route (one Triton program while the rows are few, torch above) and run the experts."""
    T, E = router_logits.shape
    if T == 0:
        return x.new_zeros(0, x.shape[1])
    t = tiling or choose_tiling(T * top_k, E)
    if triton.next_power_of_2(T) * triton.next_power_of_2(E) <= FUSED_ROUTING_MAX_TILE:
        weights, _, blocks = route_and_group(router_logits, top_k, renormalize, t.block_m)
    else:
        weights, ids = route_ref(router_logits, top_k, renormalize)
        blocks = group_by_expert(ids, E, t.block_m)
    return run_experts(x, w_gate_up, w_down, weights, blocks, top_k, t)


def fused_moe_triton(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     tiling: MoeTiling | None = None) -> torch.Tensor:
    """The experts for a given routing (weights [T, k] float32, ids [T, k])."""
    T, k = topk_ids.shape
    if T == 0:
        return x.new_zeros(0, x.shape[1])
    t = tiling or choose_tiling(T * k, w_gate_up.shape[0])
    return run_experts(x, w_gate_up, w_down, topk_weights, group_by_expert(topk_ids, w_gate_up.shape[0], t.block_m), k, t)


def route_and_group(logits: torch.Tensor, top_k: int, renormalize: bool,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, ExpertBlocks]:
    """`route_ref` and `group_by_expert` in one Triton program: (weights [T, k] float32, ids [T, k]
    int32, the rows grouped by expert in the same order as `group_by_expert`'s)."""
    T, E = logits.shape
    n = T * top_k
    num_blocks = n // block_m + min(n, E)
    dev = logits.device
    weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    rows = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    experts = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    tp, kp, nbp = (max(2, triton.next_power_of_2(v)) for v in (T, top_k, num_blocks))
    _route_group_kernel[(1,)](logits, weights, ids, rows, experts, T, E, logits.stride(0), num_blocks,
                              TOP_K=top_k, RENORM=renormalize, TP=tp, EP=max(2, triton.next_power_of_2(E)),
                              KP=kp, NBP=nbp, FILL=nbp * block_m, BM=block_m, CH=128, num_warps=8)
    return weights, ids, ExpertBlocks(rows, experts, block_m)


def experts_grouped_mm(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts as torch's grouped GEMM (`torch._grouped_mm`, CUTLASS on Hopper): the rows
    gathered into expert order, one ragged GEMM for gate and up and one for down, no padding."""
    T, k = topk_ids.shape
    E, H = w_gate_up.shape[0], x.shape[1]
    expert = topk_ids.reshape(-1).long()
    order = torch.sort(expert, stable=True).indices
    counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(0, expert, torch.ones_like(expert))
    ends = counts.cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(x[order // k], w_gate_up.transpose(1, 2), offs=ends).float().chunk(2, dim=-1)
    inter = (F.silu(gate) * up).to(x.dtype)
    y = torch._grouped_mm(inter, w_down.transpose(1, 2), offs=ends).float() * topk_weights.reshape(-1)[order, None]
    out = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
    out[order] = y.to(x.dtype)
    return out.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)


def run_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                blocks: ExpertBlocks, top_k: int, t: MoeTiling) -> torch.Tensor:
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I, n = two_i // 2, T * top_k
    assert w_down.shape == (E, H, I) and x.stride(1) == 1
    assert w_gate_up.stride(2) == 1 and w_down.stride(2) == 1
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    upcast = interpret and x.dtype == torch.bfloat16  # the interpreter's tl.dot on bf16 is wrong
    precision = "ieee" if (upcast or x.dtype == torch.float32) else "tf32"
    num_blocks, launch = blocks.experts.numel(), dict(num_warps=t.num_warps, num_stages=t.num_stages)
    tile = dict(BM=t.block_m, BN=t.block_n, BK=t.block_k, UPCAST=upcast, PRECISION=precision)

    def even(n_cols: int, k: int) -> dict:  # which masks the tiles make unnecessary
        return dict(EVEN_K=k % t.block_k == 0, EVEN=k % t.block_k == 0 and n_cols % t.block_n == 0)
    weights = topk_weights.reshape(-1).float()
    if t.split_gate_up:
        gate_up = torch.empty(n, two_i, device=x.device, dtype=x.dtype)
        _expert_gemm_kernel[(num_blocks, triton.cdiv(two_i, t.block_n))](
            x, w_gate_up, weights, gate_up, blocks.rows, blocks.experts, n, two_i, H,
            x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), gate_up.stride(0),
            A_DIV=top_k, SCALE=False, **tile, **even(two_i, H), **launch)
        gate, up = gate_up.float().chunk(2, dim=-1)
        inter = (F.silu(gate) * up).to(x.dtype)
    else:
        inter = torch.empty(n, I, device=x.device, dtype=x.dtype)
        _gate_up_kernel[(num_blocks, triton.cdiv(I, t.block_n))](
            x, w_gate_up, inter, blocks.rows, blocks.experts, n, I, H,
            x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), inter.stride(0), TOP_K=top_k, **tile,
            **even(I, H), **launch)
    out = torch.empty(n, H, device=x.device, dtype=x.dtype)
    _expert_gemm_kernel[(num_blocks, triton.cdiv(H, t.block_n))](
        inter, w_down, weights, out, blocks.rows, blocks.experts, n, H, I,
        inter.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0), A_DIV=1, SCALE=True, **tile,
        **even(H, I), **launch)
    return out.view(T, top_k, H).sum(1, dtype=torch.float32).to(x.dtype)


if triton is not None:
    @triton.jit
    def _block_rows(rows_ptr, experts_ptr, num_rows, BM: tl.constexpr):
        """The block's expert (-1: past the last) and its rows, which are < num_rows if real."""
        pid = tl.program_id(0)
        expert = tl.load(experts_ptr + pid)
        rows = tl.load(rows_ptr + pid * BM + tl.arange(0, BM))
        return expert.to(tl.int64), rows.to(tl.int64), rows < num_rows

    @triton.jit
    def _load_rows(ptrs, real, ks, K, EVEN_K: tl.constexpr):
        """A [BM, BK] tile of the block's rows; without a mask on k where BK divides K."""
        if EVEN_K:
            a = tl.load(ptrs, mask=real[:, None], other=0.0)
        else:
            a = tl.load(ptrs, mask=real[:, None] & (ks < K)[None, :], other=0.0)
        return a

    @triton.jit
    def _load_weights(ptrs, ks, cols, K, N, EVEN: tl.constexpr):
        """A [BK, BN] tile of an expert's weights; unmasked where the tiles divide K and N."""
        if EVEN:
            w = tl.load(ptrs)
        else:
            w = tl.load(ptrs, mask=(ks < K)[:, None] & (cols < N)[None, :], other=0.0)
        return w

    @triton.jit
    def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, experts_ptr, num_rows, N, K,
                        stride_x, stride_we, stride_wn, stride_o,
                        TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                        EVEN: tl.constexpr):
        """out[row, n] = silu(x[token] . gate[e, n]) * (x[token] . up[e, n]) for the block's rows;
        w: [E, 2N, K], gate rows first."""
        expert, rows, real = _block_rows(rows_ptr, experts_ptr, num_rows, BM)
        if expert < 0:
            return
        token = rows // TOP_K
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < N
        w_base = w_ptr + expert * stride_we
        gate = tl.zeros((BM, BN), dtype=tl.float32)
        up = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            a = _load_rows(x_ptr + token[:, None] * stride_x + ks[None, :], real, ks, K, EVEN_K)
            wg = _load_weights(w_base + cols[None, :] * stride_wn + ks[:, None], ks, cols, K, N, EVEN)  # [BK, BN]
            wu = _load_weights(w_base + (N + cols[None, :]) * stride_wn + ks[:, None], ks, cols, K, N, EVEN)
            gate = _dot(a, wg, gate, UPCAST, PRECISION)
            up = _dot(a, wu, up, UPCAST, PRECISION)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=real[:, None] & col_ok[None, :])

    @triton.jit
    def _expert_gemm_kernel(a_ptr, w_ptr, weights_ptr, out_ptr, rows_ptr, experts_ptr, num_rows, N, K,
                            stride_a, stride_we, stride_wn, stride_o,
                            A_DIV: tl.constexpr, SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                            EVEN_K: tl.constexpr, EVEN: tl.constexpr):
        """out[row, n] = a[row // A_DIV] . w[e, n] for the block's rows, times the row's routing
        weight if SCALE; w: [E, N, K]. A_DIV = k reads a token's hidden state for each of its rows."""
        expert, rows, real = _block_rows(rows_ptr, experts_ptr, num_rows, BM)
        if expert < 0:
            return
        a_rows = rows // A_DIV
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < N
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            a = _load_rows(a_ptr + a_rows[:, None] * stride_a + ks[None, :], real, ks, K, EVEN_K)
            w = _load_weights(w_base + cols[None, :] * stride_wn + ks[:, None], ks, cols, K, N, EVEN)
            acc = _dot(a, w, acc, UPCAST, PRECISION)
        if SCALE:
            acc = acc * tl.load(weights_ptr + rows, mask=real, other=0.0)[:, None]  # the routing weight
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=real[:, None] & col_ok[None, :])

    @triton.jit
    def _route_group_kernel(logits_ptr, weights_ptr, ids_ptr, rows_ptr, experts_ptr, T, E, stride_l, num_blocks,
                            TOP_K: tl.constexpr, RENORM: tl.constexpr, TP: tl.constexpr, EP: tl.constexpr,
                            KP: tl.constexpr, NBP: tl.constexpr, FILL: tl.constexpr, BM: tl.constexpr,
                            CH: tl.constexpr):
        """One program: softmax over experts, top k (first index on ties), renormalise; then the
        rows (token * k + choice) in expert order, each expert's padded to whole blocks of BM."""
        t = tl.arange(0, TP)
        e = tl.arange(0, EP)
        j = tl.arange(0, KP)
        t_ok, e_ok = t < T, e < E
        logit = tl.load(logits_ptr + t[:, None] * stride_l + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                        other=0.0).to(tl.float32)
        logit = tl.where(e_ok[None, :], logit, float("-inf"))
        p = tl.exp(logit - tl.max(logit, 1)[:, None])
        p = p / tl.sum(p, 1)[:, None]
        w = tl.zeros((TP, KP), dtype=tl.float32)
        ids = tl.zeros((TP, KP), dtype=tl.int32)
        for c in tl.static_range(TOP_K):
            best = tl.max(p, 1)
            pick = tl.min(tl.where(p == best[:, None], e[None, :], EP), 1)
            w = tl.where(j[None, :] == c, best[:, None], w)
            ids = tl.where(j[None, :] == c, pick[:, None], ids)
            p = tl.where(e[None, :] == pick[:, None], -1.0, p)
        if RENORM:
            w = w / tl.sum(w, 1)[:, None]
        real = t_ok[:, None] & (j[None, :] < TOP_K)
        row = t[:, None] * TOP_K + j[None, :]
        tl.store(weights_ptr + row, w, mask=real)
        tl.store(ids_ptr + row, ids, mask=real)
        n = T * TOP_K
        f = tl.arange(0, FILL)
        tl.store(rows_ptr + f, tl.zeros((FILL,), dtype=tl.int32) + n, mask=f < num_blocks * BM)  # padding
        tl.debug_barrier()  # the ids and the padding land before they are read back or overwritten
        # The rows in expert order, CH at a time from the stored ids (a one-hot [CH, EP] table):
        # first each expert's count, then each row's place, its expert's next free slot.
        counts = tl.zeros((EP,), dtype=tl.int32)
        for c in range(0, n, CH):
            r = c + tl.arange(0, CH)
            hot = (tl.load(ids_ptr + r, mask=r < n, other=EP)[:, None] == e[None, :]).to(tl.int32)
            counts += tl.sum(hot, 0)
        padded = (counts + BM - 1) // BM * BM
        ends = tl.cumsum(padded, 0)
        free = ends - padded
        for c in range(0, n, CH):
            r = c + tl.arange(0, CH)
            hot = (tl.load(ids_ptr + r, mask=r < n, other=EP)[:, None] == e[None, :]).to(tl.int32)
            place = tl.sum(hot * (free[None, :] + tl.cumsum(hot, 0) - hot), 1)
            tl.store(rows_ptr + place, r, mask=r < n)
            free += tl.sum(hot, 0)
        b = tl.arange(0, NBP)
        expert = tl.sum(((ends[None, :] <= b[:, None] * BM) & e_ok[None, :]).to(tl.int32), 1)
        tl.store(experts_ptr + b, tl.where(expert < E, expert, -1), mask=b < num_blocks)
