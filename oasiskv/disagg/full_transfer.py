"""The reads of a `full` admission (docs/disaggregation.md, "Admission"): the baseline that
vLLM's and SGLang's connectors implement, moving a request's whole KV before its first decode
step, over the same transport as RPF's reads.

Every item of the request's prompt blocks gets a local item at once; the items are then read
from the prefill peer's extent in reads of at most `max_read_bytes` each (so each read ends well
inside the transport's timeout), a few in flight at a time. The decode side polls the transfer
between its steps (`advance`) and admits the request once every read has landed; nothing of it
is read later. A failed read fails the transfer: its items go back once no read can write
into them, and its peer is dropped (`RemoteReads.fail_peer`).
"""
from __future__ import annotations

import time

import numpy as np

from oasiskv.disagg.remote_reads import RemoteReads, RemoteRequest, merge_runs
from oasiskv.disagg.transport import PendingRead, TransportError

DEFAULT_MAX_READ_BYTES = 64 << 20  # about 40 ms at the 1.5 GB/s measured host to host
READS_IN_FLIGHT = 2  # one landing while the next is posted


def plan_reads(remote: np.ndarray, local: np.ndarray, max_items: int) -> list[np.ndarray]:
    """The reads of pairs (remote item, local item): each an array [n, 3] of extents (remote
    first item, local first item, item count), adjacent items merged, at most `max_items` items
    per read (a longer extent is cut)."""
    if max_items < 1:
        raise ValueError("a read carries at least one item")
    r_first, l_first, counts = merge_runs(remote, local)
    pieces = -(-counts // max_items)
    which = np.repeat(np.arange(len(counts)), pieces)
    offset = (np.arange(len(which)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * max_items
    count = np.minimum(counts[which] - offset, max_items)
    extents = np.stack([r_first[which] + offset, l_first[which] + offset, count], 1)
    reads, start, size = [], 0, 0
    for i, n in enumerate(count.tolist()):
        if size + n > max_items:
            reads.append(extents[start:i])
            start, size = i, 0
        size += n
    if len(extents):
        reads.append(extents[start:])
    return reads


class FullTransfer:
    """One full admission's reads, from `start` to `done` (or a TransportError)."""

    def __init__(self, reads: RemoteReads, remote: RemoteRequest, plan: list[np.ndarray]):
        self.reads, self.remote, self.plan = reads, remote, plan
        self.posted = 0  # reads of the plan posted so far
        self.pending: list[PendingRead] = []
        self.bytes_read = 0
        self.done = False
        self.started = time.perf_counter()

    @classmethod
    def start(cls, reads: RemoteReads, adm, peer: str, max_blocks: int,
              max_read_bytes: int = DEFAULT_MAX_READ_BYTES) -> "FullTransfer | None":
        """The transfer of a full admission `adm` from `peer`: local items for its prompt's
        blocks of every (layer, KV head), sized for `max_blocks` blocks on the decode side, and
        the plan of their reads; None if the local arena has no room for them now."""
        L, H, _ = adm.tensors["blocks"].shape
        nb = adm.num_blocks
        if nb > max_blocks or nb > adm.remote_stride:
            raise ValueError(f"the admission holds {nb} blocks, more than the request's {max_blocks}")
        remote = RemoteRequest.new(adm.request_id, peer, adm.remote_start, adm.remote_stride, nb, L,
                                   max_blocks, H)
        remote.rereadable = False  # its lease goes once the transfer is done
        layer, block, head = (a.reshape(-1) for a in np.meshgrid(np.arange(L), np.arange(nb), np.arange(H),
                                                                  indexing="ij"))
        local = reads.place(remote, layer, block, head)
        if local is None:
            return None
        max_items = max(1, max_read_bytes // reads.store.item_bytes)
        return cls(reads, remote, plan_reads(remote.remote_item(layer, block, head), local, max_items))

    def advance(self) -> bool:
        """Settle landed reads and post the next ones; True once every read has landed. Raises
        the TransportError of a failed read, after its items went back."""
        if self.done:
            return True
        transport, ib = self.reads.transport, self.reads.store.item_bytes
        try:
            while self.pending and transport.poll(self.pending[0]):
                self.bytes_read += self.pending.pop(0).nbytes
            while len(self.pending) < READS_IN_FLIGHT and self.posted < len(self.plan):
                ext = self.plan[self.posted]
                self.pending.append(transport.read(self.remote.peer, np.stack([ext[:, 0] * ib, ext[:, 2] * ib], 1),
                                                   ext[:, 1] * ib, self.reads.read_timeout_s))
                self.posted += 1
        except TransportError as e:
            self.reads.fail_peer(self.remote.peer, e)  # its other reads fail at once from now on
            self.abandon()
            raise
        self.done = not self.pending and self.posted == len(self.plan)
        if self.done:  # nothing of it is ever read again, and its peer's failures no longer reach it
            self.remote.peer, self.remote.remote_blocks = "", 0
        return self.done

    def wait(self, spin_s: float = 0.0005) -> None:
        while not self.advance():
            time.sleep(spin_s)

    def abandon(self) -> None:
        """Give the items back once no read of this transfer can still write into them."""
        for pending in self.pending:
            try:
                while not self.reads.transport.poll(pending):
                    time.sleep(0.0005)
            except TransportError:
                pass
        self.pending = []
        self.reads.release(self.remote)
