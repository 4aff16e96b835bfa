"""What the decode side receives when it admits a disaggregated request (docs/disaggregation.md,
"Admission").

RPF (Remote Partial Fetching): the block summaries of every layer, the first step's working set
(the KV of every block the request's working set holds, per (layer, KV head): sinks, top-K,
window), the draft chain's state, the prefill's first token, and where the rest lives (the
prefill peer's transport metadata and the request's extent there). Everything else is read on
demand (`remote_reads`). `full` mode (what vLLM's and SGLang's connectors do) carries where the
KV lives and the working set's choice but no KV: the decode side reads every block over the
transport before the request's first step (`full_transfer`), builds the summaries from the keys,
and never reads again.

On the wire: one safetensors blob, the tensors as tensors and the rest as JSON in its metadata
(no pickle: the decode side loads what a peer sent).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from oasiskv.disagg.remote_reads import RemoteReads, RemoteRequest
from oasiskv.sparse.summaries import write_block_minmax

if TYPE_CHECKING:
    from oasiskv.sparse.manager import SparseManager

TRANSFER_MODES = ("rpf", "full")


@dataclass
class Admission:
    request_id: str
    mode: str  # rpf | full
    prompt_token_ids: list[int]
    first_token: int  # sampled by the prefill
    num_cached: int  # tokens whose KV exists (the prompt)
    block_size: int
    draft: int | None  # the draft chain's next token (rpf)
    step: int = 0  # the prefill's sparse step count at conversion: the LRU stamps' origin
    # Where the full KV lives: the owner's transport metadata and the request's extent there.
    peer_metadata: str = ""
    lease_ttl_s: float = 0.0
    remote_start: int = 0  # first item of the extent
    remote_stride: int = 0  # the extent's blocks per layer
    # The first token's logprobs {token id: logprob}, when the request asked for logprobs.
    first_logprobs: dict[int, float] | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # rpf: "blocks" [L, Hkv, P] int32 (the working set: logical block per position, -1 empty),
    #      "last_selected" [L, Hkv, K] int64, "kmin"/"kmax" [L, nb, Hkv, D] (summary dtype),
    #      "items" [n, 2, bs, D]: the KV of every held (layer, head, position), in the order of
    #      `held_positions(blocks)`.
    # full: "blocks", "last_selected" (the KV is read over the transport: `full_transfer`).

    @property
    def num_blocks(self) -> int:
        return -(-self.num_cached // self.block_size)

    def tensor_bytes(self) -> int:
        """KV and summary bytes carried (what the transfer modes are compared by)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to_bytes(self) -> bytes:
        meta = {k: getattr(self, k) for k in ("request_id", "mode", "prompt_token_ids", "first_token",
                                               "num_cached", "block_size", "draft", "step", "peer_metadata",
                                               "lease_ttl_s", "remote_start", "remote_stride", "first_logprobs")}
        return save_tensors({k: t.contiguous() for k, t in self.tensors.items()},
                            metadata={"admission": json.dumps(meta)})

    @classmethod
    def from_bytes(cls, data: bytes) -> "Admission":
        meta = json.loads(_metadata(data)["admission"])
        if meta.get("first_logprobs") is not None:  # JSON keys are strings
            meta["first_logprobs"] = {int(k): float(v) for k, v in meta["first_logprobs"].items()}
        if meta["mode"] not in TRANSFER_MODES:
            raise ValueError(f"unknown transfer mode {meta['mode']!r}")
        return cls(tensors=load_tensors(data), **meta)


def _metadata(data: bytes) -> dict:
    """The safetensors header's __metadata__ (the format: 8-byte little-endian length, JSON)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]).get("__metadata__", {})


def held_positions(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layer, head, position) of every held working-set position, in a fixed order."""
    return torch.nonzero(blocks >= 0, as_tuple=True)


def rpf_admission(request_id: str, seq, sparse: SparseManager) -> Admission:
    """The RPF admission of a request just converted by `sparse` (its working set as the
    conversion laid it out, `SparseManager.working_set_tables`)."""
    ws, kv, bs = seq.sparse, sparse.kv, sparse.block_size
    n = seq.num_cached_tokens
    blocks, last_selected, step = sparse.working_set_tables(ws)
    layer, head, pos = held_positions(blocks)
    slots = torch.tensor(ws.pages, dtype=torch.long)[pos] * sparse.Hkv + head
    items = kv[layer.to(kv.device), slots.to(kv.device)].cpu()
    kmin, kmax = sparse.summaries(ws, -(-n // bs))
    tensors = {"blocks": blocks.clone(), "last_selected": last_selected.clone(),
               "kmin": kmin, "kmax": kmax, "items": items}
    return Admission(request_id, "rpf", list(seq.prompt_token_ids), seq.last_token_id, n, bs,
                     ws.draft, step, remote_start=ws.extent.start, remote_stride=ws.extent.max_blocks,
                     tensors=tensors)


def full_admission(request_id: str, seq, sparse: SparseManager) -> Admission:
    """The full-transfer admission: where the request's KV lives (its host extent, which the
    decode side reads whole before its first step) and the working set's block choice (a few
    KiB), so the decode side starts from the same working set as RPF."""
    ws, extent = seq.sparse, seq.host_extent
    blocks, last_selected, step = sparse.working_set_tables(ws)
    tensors = {"blocks": blocks.clone(), "last_selected": last_selected.clone()}
    return Admission(request_id, "full", list(seq.prompt_token_ids), seq.last_token_id, seq.num_cached_tokens,
                     sparse.block_size, ws.draft, step,
                     remote_start=extent.start, remote_stride=extent.max_blocks, tensors=tensors)


@dataclass
class AdmittedState:
    """The decode side's state of an RPF admission: the remote table (the working set's items
    placed locally) and the working set's per-(layer, head) state, sized for `max_blocks`."""
    remote: RemoteRequest
    blocks: torch.Tensor  # [L, Hkv, P] int32
    last_selected: torch.Tensor  # [L, Hkv, K] int64
    kmin: torch.Tensor  # [L, max_blocks, Hkv, D]
    kmax: torch.Tensor
    items: torch.Tensor  # [n, 2, bs, D] the working set's KV, in `held_positions` order


def admit_full(adm: Admission, remote: RemoteRequest, reads: RemoteReads,
               summary_dtype: torch.dtype) -> AdmittedState:
    """Place a full admission whose blocks `full_transfer` has read into `remote`'s local items
    (nothing is read later): the summaries built from its keys as the conversion builds them,
    the working set's items taken from the local copy."""
    if adm.mode != "full":
        raise ValueError("admit_full takes a full admission")
    blocks = adm.tensors["blocks"]
    L, max_blocks, H = remote.where.shape
    nb, bs = adm.num_blocks, adm.block_size
    items = reads.store.items
    D = items.shape[-1]
    where = torch.from_numpy(remote.where[:, :nb])
    if (where < 0).any():
        raise ValueError("a full admission's blocks are not all local")
    kmin = torch.empty((L, max_blocks, H, D), dtype=summary_dtype)
    kmax = torch.empty_like(kmin)
    for layer in range(L):  # one layer's keys at a time: [nb, H, bs, D] -> tokens [n, H, D]
        keys = items[where[layer].reshape(-1), 0].view(nb, H, bs, D).transpose(1, 2).reshape(nb * bs, H, D)
        write_block_minmax(kmin[layer], kmax[layer], keys[:adm.num_cached], bs)
    layer, head, pos = held_positions(blocks)
    held = items[where[layer, blocks[layer, head, pos].long(), head]]
    return AdmittedState(remote, blocks.clone(), adm.tensors["last_selected"].clone(), kmin, kmax, held)


def admit_rpf(adm: Admission, reads: RemoteReads, peer: str, max_blocks: int) -> AdmittedState | None:
    """Place an RPF admission on the decode side: the working set's items go into the local
    arena (so no block of it is ever read again), the rest is marked remote. None if the local
    arena has no room for them."""
    if adm.mode != "rpf":
        raise ValueError("admit_rpf takes an rpf admission")
    t = adm.tensors
    blocks, kmin = t["blocks"], t["kmin"]
    L, H, _ = blocks.shape
    nb = kmin.shape[1]
    if nb > max_blocks:
        raise ValueError(f"the admission holds {nb} blocks, more than the request's {max_blocks}")
    remote = RemoteRequest.new(adm.request_id, peer, adm.remote_start, adm.remote_stride,
                               adm.num_cached // adm.block_size, L, max_blocks, H)
    layer, head, pos = held_positions(blocks)
    block = blocks[layer, head, pos].long()
    local = reads.place(remote, layer.numpy(), block.numpy(), head.numpy())
    if local is None:
        return None
    reads.store.items[torch.from_numpy(np.ascontiguousarray(local))] = t["items"]
    reads.admit(remote)
    full_kmin = kmin.new_empty((L, max_blocks, H, kmin.shape[3]))
    full_kmax = torch.empty_like(full_kmin)
    full_kmin[:, :nb], full_kmax[:, :nb] = kmin, t["kmax"]
    return AdmittedState(remote, blocks.clone(), t["last_selected"].clone(), full_kmin, full_kmax, t["items"])
