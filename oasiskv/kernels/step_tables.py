"""The foreground's tables for one pipelined sparse decode step, built on the device from the
pipeline's state (`LookaheadPipeline.step_tables` names the state and the outputs).

Per (layer, row, kv head), the slots the decode kernel walks: sinks, then the dynamic slots
that hold a block (in slot order), then the window's valid blocks oldest first; the slots
that hold nothing follow, in the same order, past the valid count. Per row: where the token's
K/V goes, the positions of its two query rows (token, draft), and the values the stages read
later in the step (the next step's block count and window, whether the token completes its
block, ...).

On CUDA this is one launch. The torch form, kept for CPU and as the reference, is ~60 small
launches that would run serially at the head of every step, before layer 0 could start.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch form
    triton = None


class RowState(NamedTuple):
    """The per-row values the stages read after the foreground has built its tables, [R] each:
    they are written here (not returned) so the step's graph keeps their addresses."""
    next_blocks: torch.Tensor  # long: blocks of the row at the next step (0: inactive)
    next_window: torch.Tensor  # long: the next step's first window block
    completes: torch.Tensor  # bool: this token fills its block (write-through)
    window_slot: torch.Tensor  # long: head 0's slot of the token's block
    block: torch.Tensor  # long: the block the token goes to
    summary_block: torch.Tensor  # long: its summary row, -1 inactive
    first_in_block: torch.Tensor  # bool: the token starts its block


class WriteThrough(NamedTuple):
    """A step's write-through, [R] each: whether the row's token completed its block, head 0's
    slot of that block, and the block. With deferred write-through the step after takes it."""
    completes: torch.Tensor  # bool
    window_slot: torch.Tensor  # long
    block: torch.Tensor  # long


class StepTables(NamedTuple):
    """What the foreground reads, for R rows x 2 query rows (token, draft) each."""
    slot_tables: torch.Tensor  # [L, R, H, P] int32
    cache_lens: torch.Tensor  # [L, R, H] int32: cached tokens each (layer, row, head) attends
    write_slots: torch.Tensor  # [2R, H] int32: the token's K/V slot, -1 (inactive rows, drafts)
    write_offsets: torch.Tensor  # [2R] int32: offset inside the block
    positions: torch.Tensor  # [2R] long: the token's position and its draft's


def step_tables(cached: torch.Tensor, active: torch.Tensor, pages: torch.Tensor, resident: torch.Tensor,
                summary_offset: torch.Tensor, num_heads: int, num_sink: int, window: int, block_size: int,
                max_position: int, rows: RowState, last: WriteThrough | None = None) -> StepTables:
    """cached [R] int32 (tokens before this step's), active [R] bool, pages [R, P] int32 (the
    rows' working-set pages, slot i of head h = pages[i] * H + h), resident [L, >= R * H, K]
    int32 (each dynamic slot's block, -1 empty; rows r * H + h, H = num_heads), summary_offset
    [R]; slots [0, S) of pages are the sinks, then K dynamic, then the window ring. Fills
    `rows` ([R] views; `last` first takes the write-through values rows held, the last step's)
    and returns the tables (Triton on CUDA, `step_tables_torch` elsewhere)."""
    if cached.is_cuda and triton is not None:
        return step_tables_triton(cached, active, pages, resident, summary_offset, num_heads, num_sink, window,
                                  block_size, max_position, rows, last)
    return step_tables_torch(cached, active, pages, resident, summary_offset, num_heads, num_sink, window,
                             block_size, max_position, rows, last)


def step_tables_torch(cached, active, pages, resident, summary_offset, num_heads, num_sink, window, block_size,
                      max_position, rows: RowState, last: WriteThrough | None = None) -> StepTables:
    H, S, W, bs = num_heads, num_sink, window, block_size
    R, P = pages.shape
    L, K = resident.shape[0], resident.shape[2]
    n = cached.long()
    cur, partial = n // bs, n % bs
    win = (cur - W + 1).clamp_min(S)
    dev = cached.device
    # The window's positions oldest block first: position (cur + 1 + i) % W holds block
    # cur - W + 1 + i. Valid: not before the window's start, and written (the current
    # block only once it holds a token).
    age_order = (cur[:, None] + 1 + torch.arange(W, device=dev)) % W  # [R, W]
    block_at = cur[:, None] - W + 1 + torch.arange(W, device=dev)
    wvalid = (block_at >= win[:, None]) & ((block_at < cur[:, None]) | (partial[:, None] > 0))
    # Every slot in walking order (sinks, dynamic by slot, window oldest first), and which
    # hold a block; valid slots move to the front in that order (a prefix sum, not a sort).
    src = torch.cat([torch.arange(S + K, device=dev).expand(R, S + K), S + K + age_order], 1)
    # A sink holds its block once the block has a token (a prompt shorter than the sinks fills
    # them as it decodes: the newest token then goes to its sink, the partial block last).
    sinks = (torch.arange(S, device=dev) * bs)[None, :] < n[:, None]  # [R, S]
    valid = torch.cat([sinks[None, :, None, :].expand(L, R, H, S),
                       resident[:, :R * H].view(L, R, H, K) >= 0,
                       wvalid[None, :, None, :].expand(L, R, H, W)], -1)
    n_valid = valid.sum(-1, keepdim=True)
    dst = torch.where(valid, valid.cumsum(-1) - 1, n_valid + (~valid).cumsum(-1) - 1)
    order = torch.empty_like(dst).scatter_(-1, dst, src[None, :, None, :].expand(L, R, H, P))
    slot_pages = pages.long()[None, :, None, :].expand(L, R, H, P).gather(-1, order)
    heads = torch.arange(H, device=dev)
    tables = (slot_pages * H + heads[None, None, :, None]).int()
    blocks = n_valid[..., 0] - (partial > 0).long()[None, :, None]
    lens = torch.where(active[None, :, None], blocks * bs + partial[None, :, None], 0).int()
    page = pages.long().gather(1, torch.where(cur < S, cur, S + K + cur % W)[:, None])  # [R, 1]: the token's block
    token_slots = torch.where(active[:, None], page * H + heads[None, :], -1).int()
    write_slots = torch.stack([token_slots, torch.full_like(token_slots, -1)], 1).view(2 * R, H)
    write_offsets = torch.stack([partial.int(), torch.zeros_like(partial.int())], 1).view(-1)
    positions = torch.stack([n, (n + 1).clamp_max(max_position - 1)], 1).view(-1)
    # For the stages: the next step adds token n + 1; sinks and window are resident, so
    # never predicted. And whether this token completes its block (write-through).
    if last is not None:
        for keep, now in zip(last, (rows.completes, rows.window_slot, rows.block)):
            keep.copy_(now)
    rows.next_blocks.copy_(torch.where(active, (n + 1) // bs + 1, 0))
    rows.next_window.copy_(((n + 1) // bs - W + 1).clamp_min(S))
    rows.completes.copy_(active & ((n + 1) % bs == 0))
    rows.window_slot.copy_(page[:, 0] * H)
    rows.block.copy_(cur)
    rows.summary_block.copy_(torch.where(active, summary_offset.long() + cur, -1))
    rows.first_in_block.copy_(partial == 0)
    return StepTables(tables, lens, write_slots, write_offsets, positions)


def step_tables_triton(cached, active, pages, resident, summary_offset, num_heads, num_sink, window, block_size,
                       max_position, rows: RowState, last: WriteThrough | None = None) -> StepTables:
    """`step_tables` in one launch: a program per (layer, row) builds that row's H tables in
    registers (the same prefix-sum compaction as the torch form); layer 0's program also
    writes the row's values."""
    H, S, W = num_heads, num_sink, window
    R, P = pages.shape
    L, K = resident.shape[0], resident.shape[2]
    assert P == S + K + W and pages.is_contiguous() and resident.stride(2) == 1 and resident.stride(1) == K
    assert all(t.is_contiguous() for t in rows) and (last is None or all(t.is_contiguous() for t in last))
    dev = cached.device
    tables = torch.empty(L, R, H, P, dtype=torch.int32, device=dev)
    lens = torch.empty(L, R, H, dtype=torch.int32, device=dev)
    write_slots = torch.empty(2 * R, H, dtype=torch.int32, device=dev)
    write_offsets = torch.empty(2 * R, dtype=torch.int32, device=dev)
    positions = torch.empty(2 * R, dtype=torch.long, device=dev)
    if R:
        _step_tables_kernel[(L, R)](
            cached, active, pages, resident, summary_offset, tables, lens, write_slots, write_offsets, positions,
            *rows, *(last if last is not None else rows[2:5]),  # (unread without KEEP)
            resident.stride(0), R, max_position,
            H=H, S=S, K=K, W=W, P=P, BS=block_size, HP=triton.next_power_of_2(H), PP=triton.next_power_of_2(P),
            KEEP=last is not None, num_warps=4)
    return StepTables(tables, lens, write_slots, write_offsets, positions)


if triton is not None:

    @triton.jit
    def _step_tables_kernel(cached_ptr, active_ptr, pages_ptr, res_ptr, soff_ptr, tables_ptr, lens_ptr,
                            wslot_ptr, woff_ptr, pos_ptr, next_blocks_ptr, next_window_ptr, completes_ptr,
                            window_slot_ptr, block_ptr, summary_block_ptr, first_ptr, last_completes_ptr,
                            last_window_slot_ptr, last_block_ptr, stride_rl, R, max_position,
                            H: tl.constexpr, S: tl.constexpr, K: tl.constexpr, W: tl.constexpr,
                            P: tl.constexpr, BS: tl.constexpr, HP: tl.constexpr, PP: tl.constexpr,
                            KEEP: tl.constexpr):
        layer = tl.program_id(0)
        r = tl.program_id(1)
        n = tl.load(cached_ptr + r)
        act = tl.load(active_ptr + r) != 0
        cur = n // BS
        partial = n % BS
        win = tl.maximum(cur - W + 1, S)
        h = tl.arange(0, HP)
        j = tl.arange(0, PP)
        hm = h < H
        in_row = j < P
        is_dyn = (j >= S) & (j < S + K)
        is_win = (j >= S + K) & in_row
        res = tl.load(res_ptr + layer.to(tl.int64) * stride_rl + (r * H + h[:, None]) * K + (j[None, :] - S),
                      mask=hm[:, None] & is_dyn[None, :], other=-1)
        # The window ring: position i (slot S + K + i) walks block cur - W + 1 + i, at ring
        # position (cur + 1 + i) % W; valid from the window's start on, and written.
        wi = j - S - K
        block_at = cur - W + 1 + wi
        wvalid = is_win & (block_at >= win) & ((block_at < cur) | (partial > 0))
        src = tl.where(is_win, S + K + (cur + 1 + wi) % W, j)
        valid = ((j < S) & (j * BS < n))[None, :] | (is_dyn[None, :] & (res >= 0)) | wvalid[None, :]  # [HP, PP]
        valid = valid & in_row[None, :]
        vi = valid.to(tl.int32)
        invalid = ((valid == 0) & in_row[None, :]).to(tl.int32)
        n_valid = tl.sum(vi, axis=1)  # [HP]
        dst = tl.where(valid, tl.cumsum(vi, axis=1) - 1, n_valid[:, None] + tl.cumsum(invalid, axis=1) - 1)
        page = tl.load(pages_ptr + r * P + src, mask=in_row, other=0)  # [PP]
        at = (layer * R + r) * H + h  # [HP]
        tl.store(tables_ptr + at[:, None].to(tl.int64) * P + dst, page[None, :] * H + h[:, None],
                 mask=hm[:, None] & in_row[None, :])
        blocks = n_valid - (partial > 0).to(tl.int32)
        tl.store(lens_ptr + at, tl.where(act, blocks * BS + partial, 0), mask=hm)
        if layer == 0:
            wpage = tl.load(pages_ptr + r * P + tl.where(cur < S, cur, S + K + cur % W))  # the token's block
            tl.store(wslot_ptr + (2 * r) * H + h, tl.where(act, wpage * H + h, -1), mask=hm)
            tl.store(wslot_ptr + (2 * r + 1) * H + h, tl.full([HP], -1, tl.int32), mask=hm)
            tl.store(woff_ptr + 2 * r, partial)
            tl.store(woff_ptr + 2 * r + 1, partial * 0)
            tl.store(pos_ptr + 2 * r, n.to(tl.int64))
            tl.store(pos_ptr + 2 * r + 1, tl.minimum(n + 1, max_position - 1).to(tl.int64))
            if KEEP:  # the last step's write-through, before this step's replaces it
                tl.store(last_completes_ptr + r, tl.load(completes_ptr + r))
                tl.store(last_window_slot_ptr + r, tl.load(window_slot_ptr + r))
                tl.store(last_block_ptr + r, tl.load(block_ptr + r))
            nxt = n + 1
            tl.store(next_blocks_ptr + r, tl.where(act, nxt // BS + 1, 0).to(tl.int64))
            tl.store(next_window_ptr + r, tl.maximum(nxt // BS - W + 1, S).to(tl.int64))
            tl.store(completes_ptr + r, act & (nxt % BS == 0))
            tl.store(window_slot_ptr + r, (wpage * H).to(tl.int64))
            tl.store(block_ptr + r, cur.to(tl.int64))
            tl.store(summary_block_ptr + r, tl.where(act, tl.load(soff_ptr + r) + cur, -1).to(tl.int64))
            tl.store(first_ptr + r, partial == 0)
