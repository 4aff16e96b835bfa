"""The transport between a prefill instance (the owner of a request's full KV) and a decode
instance (which reads the blocks it needs), docs/disaggregation.md.

Each side registers one host memory region, once, at start (the host pool's arena as bytes).
The owner exports metadata (`metadata()`); a reader imports it (`add_peer`) and then posts
batched one-sided reads: N (remote offset, length) extents of the peer's region into N local
offsets of its own region. A read completes, fails or times out; the reader polls it.

Failure contract, the same for every implementation:
  - an extent outside the peer's region is refused (`ReadRefused`) and nothing is read;
  - a read not done by its deadline fails with `ReadTimeout`, and the peer is dropped: its
    later reads fail at once with `PeerDisconnected` (the owner's leases expire on their own);
  - a dead peer fails the reads in flight with `PeerDisconnected` within a second or so;
  - one peer's failure never touches the reads of another peer.
A transport cannot tell memory the owner has reused from the memory it registered: keeping an
extent alive while a reader may read it is the job of the owner's leases (`leases.py`).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from nixl_cu12 import nixl_xfer_handle  # nixl_cu13 on CUDA 13 hosts: the same class

DEFAULT_READ_TIMEOUT_S = 5.0


class TransportError(RuntimeError):
    """A read that failed; `peer` names the peer it was addressed to."""

    def __init__(self, peer: str, message: str):
        super().__init__(f"peer {peer}: {message}")
        self.peer = peer


class ReadRefused(TransportError):
    """An extent outside the peer's registered region (or the reader's own)."""


class ReadTimeout(TransportError):
    """The read was not done by its deadline."""


class PeerDisconnected(TransportError):
    """The peer is gone (its process died, its connection dropped, or it was dropped after a
    timeout); every read addressed to it fails."""


@dataclass
class PendingRead:
    """One posted batched read."""
    peer: str
    nbytes: int
    deadline: float
    done: bool = False
    error: TransportError | None = None
    state: nixl_xfer_handle | None = field(default=None, repr=False)  # NIXL's transfer, while posted


def as_extents(remote: np.ndarray | list, local_offsets: np.ndarray | list) -> tuple[np.ndarray, np.ndarray]:
    """remote [N, 2] (offset, length) and local_offsets [N] as int64 arrays, shapes checked."""
    remote = np.asarray(remote, dtype=np.int64).reshape(-1, 2)
    local = np.asarray(local_offsets, dtype=np.int64).reshape(-1)
    if remote.shape[0] != local.shape[0]:
        raise ValueError(f"{remote.shape[0]} remote extents but {local.shape[0]} local offsets")
    return remote, local


def out_of_range(offsets: np.ndarray, lengths: np.ndarray, size: int) -> bool:
    """Any extent that is empty-negative or leaves [0, size)."""
    return bool(len(offsets)) and bool((offsets < 0).any() or (lengths <= 0).any()
                                       or (offsets + lengths > size).any())


def region_bytes(region: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor as a flat uint8 view of the same memory."""
    if region.device.type != "cpu" or not region.is_contiguous():
        raise ValueError("a registered region is a contiguous host tensor")
    return region.view(-1).view(torch.uint8)


class Transport(ABC):
    """One side's endpoint. Not thread-safe: one thread posts and polls."""

    name: str = ""

    def __init__(self):
        self.region: torch.Tensor | None = None  # flat uint8 view of the registered memory

    # ---- set-up ---------------------------------------------------------------------
    def register(self, region: torch.Tensor) -> None:
        """The one local region, peers read it and local reads land in it. Once per transport."""
        if self.region is not None:
            raise RuntimeError("a transport registers one region, once")
        self.region = region_bytes(region)
        self._register(self.region)

    @abstractmethod
    def _register(self, region: torch.Tensor) -> None: ...

    @abstractmethod
    def serve(self) -> None:
        """Owner side: start answering peers' reads of the registered region (once)."""

    @abstractmethod
    def metadata(self) -> bytes:
        """Owner side, after `serve`: what a reader passes to `add_peer` to read this region."""

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Connect to the peer that exported `metadata`; returns its name."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget the peer; its reads in flight fail with PeerDisconnected."""

    @abstractmethod
    def peer_size(self, peer: str) -> int:
        """Bytes of the peer's registered region."""

    # ---- reads ----------------------------------------------------------------------
    def read(self, peer: str, remote: np.ndarray | list, local_offsets: np.ndarray | list,
             timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> PendingRead:
        """Post one batched read: remote[i] = (offset, length) of the peer's region into
        local_offsets[i] of this side's region. Raises ReadRefused for an extent out of range
        (on either side) and PeerDisconnected for a peer already dropped."""
        if self.region is None:
            raise RuntimeError("register the local region before reading")
        remote, local = as_extents(remote, local_offsets)
        offsets, lengths = remote[:, 0], remote[:, 1]
        if out_of_range(offsets, lengths, self.peer_size(peer)):
            raise ReadRefused(peer, "an extent lies outside the peer's registered region")
        if out_of_range(local, lengths, self.region.numel()):
            raise ReadRefused(peer, "a local offset lies outside this side's registered region")
        pending = PendingRead(peer, int(lengths.sum()), time.monotonic() + timeout_s)
        if len(offsets):
            self._post(pending, offsets, lengths, local)
        else:
            pending.done = True
        return pending

    @abstractmethod
    def _post(self, pending: PendingRead, offsets: np.ndarray, lengths: np.ndarray,
              local: np.ndarray) -> None: ...

    def poll(self, pending: PendingRead) -> bool:
        """True once the read is complete; raises its TransportError if it failed. Past its
        deadline it fails with ReadTimeout and the peer is dropped."""
        if not pending.done and pending.error is None:
            self._progress(pending)
        if pending.error is not None:
            raise pending.error
        if not pending.done and time.monotonic() > pending.deadline:
            pending.error = ReadTimeout(pending.peer, f"read of {pending.nbytes} bytes timed out")
            self._drop(pending)
            raise pending.error
        return pending.done

    def wait(self, pending: PendingRead, spin_s: float = 0.0005) -> None:
        """Poll until done (or the read's error)."""
        while not self.poll(pending):
            time.sleep(spin_s)

    @abstractmethod
    def _progress(self, pending: PendingRead) -> None:
        """Advance the read; set pending.done or pending.error."""

    @abstractmethod
    def _drop(self, pending: PendingRead) -> None:
        """Drop the peer of a read that timed out: abandon the read; its other reads fail."""

    def close(self) -> None:
        """Release connections and the registration."""
