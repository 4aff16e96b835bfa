"""The decode side's remote blocks (docs/disaggregation.md, "Remote reads each step").

A disaggregated request's full KV stays in its prefill instance's host pool, laid out as every
extent there, `[layer][block][head]` items from `remote_start`. The decode side keeps a table
per request, `where[layer, block, head]`: the local item holding it (`LocalItems`), REMOTE, or
IN_FLIGHT. Each step the sparse stages `want` the items they predict; `flush` turns everything
wanted since the last flush into one batched read per prefill peer, merged across requests and
layers, under a byte budget that takes items layer by layer and within a layer in the order
they were wanted (each head's blocks best first), with adjacent items merged into one extent;
`poll` marks the items of completed reads local, and they count from then on. An item is read at most once: local and in-flight items are
never asked again. A peer's failed read fails every request of that peer (`failed`), whose
items are freed once no read can still write into them.

The local arena is a cache of the prefill's host pool: with `evict` (the batched pipeline,
whose reads and placements all happen between steps), a read or placement that finds it full
first gives back the prompt items that arrived earliest (FIFO), which a later step reads again
if it predicts them; blocks the decode side completed itself are never given back. Without it,
reads leave each request room for the blocks it completes, and what does not fit is left for
a later step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from oasiskv.disagg.local_items import LocalItems
from oasiskv.disagg.transport import PendingRead, Transport, TransportError

REMOTE, IN_FLIGHT = -1, -2


class HostArenaFull(TransportError):
    """A block the decode side completed found no room in its arena (--remote-kv-gb)."""


@dataclass
class RemoteRequest:
    """One disaggregated request on the decode side."""
    request_id: str
    peer: str  # the prefill instance that holds its full KV
    remote_start: int  # first item of its extent in the peer's region
    remote_stride: int  # the peer extent's blocks per layer (its max_blocks)
    remote_blocks: int  # blocks complete on the peer (a partial one changes here: never read)
    where: np.ndarray  # [L, max_blocks, Hkv] int64: local item, REMOTE or IN_FLIGHT
    reads_in_flight: int = 0
    items_held: int = 0  # local items it has taken (placed or read); they go back at release
    items_peak: int = 0  # the most it held at once
    rereadable: bool = True  # False once its prefill may free its KV (a full transfer's): never evicted
    bytes_read: int = 0  # remote bytes received for it
    error: TransportError | None = None
    released: bool = False
    # Flat where-indices that became local since the last `take_arrived`, when someone keeps a
    # copy of `where` (the pipeline's item map); None: not logged.
    arrived: list[np.ndarray] | None = None

    @classmethod
    def new(cls, request_id: str, peer: str, remote_start: int, remote_stride: int, remote_blocks: int,
            num_layers: int, max_blocks: int, num_kv_heads: int) -> "RemoteRequest":
        """max_blocks: blocks per layer on the decode side (prompt and generated tokens);
        blocks from `remote_blocks` on exist only locally."""
        where = np.full((num_layers, max_blocks, num_kv_heads), REMOTE, dtype=np.int64)
        return cls(request_id, peer, remote_start, remote_stride, remote_blocks, where)

    def remote_item(self, layer, block, head) -> np.ndarray:
        H = self.where.shape[2]
        return self.remote_start + (np.asarray(layer) * self.remote_stride + np.asarray(block)) * H \
            + np.asarray(head)

    def local_items(self) -> np.ndarray:
        return self.where[self.where >= 0]

    def take_arrived(self) -> np.ndarray:
        """The flat where-indices that became local since the last call (logging from now on)."""
        got = np.concatenate(self.arrived) if self.arrived else np.zeros(0, dtype=np.int64)
        self.arrived = []
        return got


def _prompt_items(req: RemoteRequest, flat: np.ndarray) -> np.ndarray:
    """The where-indices among `flat` of blocks the prefill holds (readable again)."""
    return flat[np.unravel_index(flat, req.where.shape)[1] < req.remote_blocks]


def merge_runs(remote: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs (remote item, local item), sorted by remote item, as extents: (remote first item,
    local first item, item count) of every run adjacent on both sides."""
    order = np.argsort(remote, kind="stable")
    r, l = remote[order], local[order]
    if not len(r):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(r) != 1) | (np.diff(l) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    counts = np.diff(np.concatenate([starts, [len(r)]]))
    return r[starts], l[starts], counts


@dataclass
class _Read:
    pending: PendingRead
    items: list[tuple[RemoteRequest, np.ndarray, np.ndarray]]  # (request, flat where-index, local item)


@dataclass
class ReadTotals:
    bytes_read: int = 0  # remote bytes received
    reads: int = 0  # batched reads posted
    extents: int = 0  # extents in them, after merging
    items_over_budget: int = 0  # wanted items left for a later step by the byte budget
    items_no_room: int = 0  # wanted items left for a later step: the local arena was full
    items_evicted: int = 0  # local prompt items given back to make room (read again if wanted)
    items_peer_busy: int = 0  # wanted items not asked: their peer's previous read was still in flight
    failed_requests: int = 0


class RemoteReads:
    """The batched remote reads of one decode instance."""

    def __init__(self, transport: Transport, store: LocalItems, read_timeout_s: float = 5.0,
                 evict: bool = False):
        self.transport, self.store, self.read_timeout_s = transport, store, read_timeout_s
        self.evict = evict
        self._arrival: deque[tuple[RemoteRequest, np.ndarray]] = deque()  # evictable items, oldest first
        self._wanted: list[tuple[RemoteRequest, np.ndarray]] = []  # (request, flat where-indices)
        self._reads: list[_Read] = []
        self._doomed: list[RemoteRequest] = []  # released or failed while reads were in flight
        self.failed: list[RemoteRequest] = []  # requests whose peer failed, for the engine to abort
        self.tracked: list[RemoteRequest] = []  # admitted and not released
        self.totals = ReadTotals()

    # ---- per step -------------------------------------------------------------------
    def want(self, req: RemoteRequest, layer, block, head) -> np.ndarray:
        """Ask for items of `req` (broadcast arrays); returns a bool mask of those local now."""
        layer, block, head = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (layer, block, head)))
        state = req.where[layer, block, head]
        missing = (state == REMOTE) & (block < req.remote_blocks)
        if missing.any() and req.error is None and not req.released:
            flat = np.ravel_multi_index((layer[missing], block[missing], head[missing]), req.where.shape)
            self._wanted.append((req, flat))
        return state >= 0

    def flush(self, budget_bytes: int | None = None) -> int:
        """Post one read per peer for the items wanted since the last flush, at most
        `budget_bytes` in all, taken layer by layer and within a layer in the order asked;
        returns the bytes posted. A peer whose previous read is still in flight gets none.
        Items over the budget or not asked are dropped (the stages ask again next step if they
        still want them)."""
        busy = self.busy_peers()  # one read in flight per peer: the reads go at the link's pace
        asks = [(req, flat) for req, flat in self._wanted
                if req.error is None and not req.released]
        self._wanted = []
        self.totals.items_peer_busy += sum(len(flat) for req, flat in asks if req.peer in busy)
        asks = [(req, flat) for req, flat in asks if req.peer not in busy]
        # Each item once and not asked by an earlier flush: marked in flight as it is taken.
        taken: list[tuple[RemoteRequest, np.ndarray]] = []
        for req, flat in asks:
            where = req.where.reshape(-1)
            flat = flat[where[flat] == REMOTE]
            if len(flat):
                tag = IN_FLIGHT - 1 - np.arange(len(flat))  # an item asked twice keeps one tag
                where[flat] = tag
                flat = flat[where[flat] == tag]
                where[flat] = IN_FLIGHT
                taken.append((req, flat))
        if budget_bytes is not None:  # layer by layer across requests, in the order asked
            taken = self._within_budget(taken, budget_bytes // self.store.item_bytes)
        by_peer: dict[str, list[tuple[RemoteRequest, np.ndarray]]] = {}
        for req, flat in taken:
            by_peer.setdefault(req.peer, []).append((req, flat))
        posted = 0
        for peer, parts in by_peer.items():
            posted += self._post(peer, parts)
        return posted

    def _within_budget(self, taken: list[tuple[RemoteRequest, np.ndarray]], keep: int
                       ) -> list[tuple[RemoteRequest, np.ndarray]]:
        """The first `keep` items of `taken` taken layer by layer (stable: within a layer in
        the order asked); the others go back to REMOTE."""
        total = sum(len(flat) for _, flat in taken)
        if total <= keep:
            return taken
        who = np.concatenate([np.full(len(flat), i) for i, (_, flat) in enumerate(taken)])
        flat = np.concatenate([flat for _, flat in taken])
        layer = flat // np.array([req.where[0].size for req, _ in taken])[who]
        chosen = np.zeros(total, dtype=bool)
        chosen[np.argsort(layer, kind="stable")[:max(0, keep)]] = True
        self.totals.items_over_budget += total - int(chosen.sum())
        out = []
        for i, (req, _) in enumerate(taken):
            mine, ok = flat[who == i], chosen[who == i]
            req.where.reshape(-1)[mine[~ok]] = REMOTE
            if ok.any():
                out.append((req, mine[ok]))
        return out

    def _post(self, peer: str, parts: list[tuple[RemoteRequest, np.ndarray]]) -> int:
        n = sum(len(flat) for _, flat in parts)
        room = self._room(n, reserve=self._headroom())
        if room < n:  # the local arena is full: what does not fit stays remote, asked again later
            self.totals.items_no_room += n - room
            kept, left = [], room
            for req, flat in parts:
                req.where.reshape(-1)[flat[left:]] = REMOTE
                if left:
                    kept.append((req, flat[:left]))
                left = max(0, left - len(flat))
            parts, n = kept, room
            if not n:
                return 0
        local = self.store.allocate(n)
        items, remote, at = [], [], 0
        for req, flat in parts:
            layer, block, head = np.unravel_index(flat, req.where.shape)
            remote.append(req.remote_item(layer, block, head))
            items.append((req, flat, local[at:at + len(flat)]))
            at += len(flat)
        r_first, l_first, counts = merge_runs(np.concatenate(remote), local)
        ib = self.store.item_bytes
        try:
            pending = self.transport.read(peer, np.stack([r_first * ib, counts * ib], 1), l_first * ib,
                                          self.read_timeout_s)
        except TransportError as e:
            self.store.free(local)
            for req, flat, _ in items:
                req.where.reshape(-1)[flat] = REMOTE
            self.fail_peer(peer, e)
            return 0
        for req, _, _ in items:
            req.reads_in_flight += 1
        self._reads.append(_Read(pending, items))
        self.totals.reads += 1
        self.totals.extents += len(counts)
        return n * ib

    def poll(self) -> None:
        """Settle the reads that are done or failed: their items become local (eligible next
        step), or their peer's requests fail."""
        still = []
        for read in self._reads:
            try:
                done = self.transport.poll(read.pending)
            except TransportError as e:
                self._settle(read, ok=False)
                self.fail_peer(read.pending.peer, e)
                continue
            if done:
                self._settle(read, ok=True)
            else:
                still.append(read)
        self._reads = still
        self._free_doomed()

    def wait(self) -> None:
        """Poll until no read is in flight (`--rpf-strict`, and tests)."""
        while self._reads:
            self.poll()

    def _settle(self, read: _Read, ok: bool) -> None:
        for req, flat, local in read.items:
            req.reads_in_flight -= 1
            if ok and req.error is None and not req.released:
                req.where.reshape(-1)[flat] = local
                if req.arrived is not None:
                    req.arrived.append(flat)
                self._hold(req, flat, len(local))
                req.bytes_read += len(local) * self.store.item_bytes
                self.totals.bytes_read += len(local) * self.store.item_bytes
            else:
                req.where.reshape(-1)[flat] = REMOTE
                self.store.free(local)

    # ---- lifetimes ------------------------------------------------------------------
    def fail_peer(self, peer: str, error: TransportError) -> None:
        """Every request of the peer fails (`failed`, for the engine to abort) and the peer is
        dropped: a read failed, or its owner stopped answering heartbeats."""
        for req in self._requests_of(peer):
            if req.error is None:
                req.error = error
                self.failed.append(req)
                self.totals.failed_requests += 1
        self.transport.remove_peer(peer)

    def _requests_of(self, peer: str) -> list[RemoteRequest]:
        seen = {id(r): r for read in self._reads for r, _, _ in read.items if r.peer == peer}
        seen.update({id(r): r for r, _ in self._wanted if r.peer == peer})
        seen.update({id(r): r for r in self.tracked if r.peer == peer})
        return list(seen.values())

    def admit(self, req: RemoteRequest) -> None:
        """Track the request, so a failure of its peer reaches it even between reads."""
        self.tracked.append(req)

    def mapped(self, req: RemoteRequest) -> None:
        """The pipeline keeps a map of the request's table from now on (`arrived` logs its
        changes): the prompt items it holds may be given back when the arena is full."""
        req.arrived = []
        if self.evict and req.rereadable:
            self._arrival.append((req, _prompt_items(req, np.flatnonzero(req.where.reshape(-1) >= 0))))

    def fail_request(self, req: RemoteRequest, error: TransportError) -> None:
        """This request alone fails (`failed`, for the engine to end it)."""
        if req.error is None:
            req.error = error
            self.failed.append(req)
            self.totals.failed_requests += 1

    def place(self, req: RemoteRequest, layer, block, head) -> np.ndarray | None:
        """Local items for items of `req` that arrive otherwise (the admission's working set,
        blocks the decode side completes itself), marked local; None if the arena is full.
        The caller writes them (`store.items[returned]`). Items already local keep theirs."""
        layer, block, head = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (layer, block, head)))
        flat = np.ravel_multi_index((layer.reshape(-1), block.reshape(-1), head.reshape(-1)), req.where.shape)
        where = req.where.reshape(-1)
        if (where[flat] == IN_FLIGHT).any():
            raise ValueError("an item placed while a read of it is in flight")
        new = np.unique(flat[where[flat] == REMOTE])
        if self._room(len(new)) < len(new):
            return None
        where[new] = self.store.allocate(len(new))
        if req.arrived is not None:
            req.arrived.append(new)
        self._hold(req, _prompt_items(req, new), len(new))
        return where[flat]

    # ---- the arena ------------------------------------------------------------------
    def _hold(self, req: RemoteRequest, evictable: np.ndarray, n: int) -> None:
        req.items_held += n
        req.items_peak = max(req.items_peak, req.items_held)
        if self.evict and req.rereadable and req.arrived is not None and len(evictable):
            self._arrival.append((req, evictable))

    def _headroom(self) -> int:
        """Without eviction, reads leave two blocks of every layer and head to each tracked
        request, for the blocks it completes itself."""
        if self.evict or not self.tracked:
            return 0
        L, _, H = self.tracked[0].where.shape
        return 2 * L * H * len(self.tracked)

    def _room(self, n: int, reserve: int = 0) -> int:
        """How many of n items the arena can take now, leaving `reserve`, after giving back
        the earliest arrived evictable items where eviction is on."""
        short = n + reserve - self.store.items_free
        if short > 0 and self.evict:
            self._evict(short)
        return max(0, min(n, self.store.items_free - reserve))

    def _evict(self, n: int) -> None:
        """Give back up to n local prompt items, those that arrived first; the pipeline's map
        learns of them through `arrived` (their entries read REMOTE now)."""
        freed = 0
        while freed < n and self._arrival:
            req, flat = self._arrival.popleft()
            where = req.where.reshape(-1)
            flat = flat[where[flat] >= 0]
            if req.released or not len(flat):
                continue
            take, rest = flat[:n - freed], flat[n - freed:]
            if len(rest):
                self._arrival.appendleft((req, rest))
            self.store.free(where[take])
            where[take] = REMOTE
            req.arrived.append(take)
            req.items_held -= len(take)
            freed += len(take)
        self.totals.items_evicted += freed

    def release(self, req: RemoteRequest) -> None:
        """The request is done: its local items go back once no read writes into them."""
        req.released = True
        self.tracked = [r for r in self.tracked if r is not req]  # by identity: `==` compares arrays
        if self.evict:
            self._arrival = deque(e for e in self._arrival if e[0] is not req)
        self._doomed.append(req)
        self._free_doomed()

    def _free_doomed(self) -> None:
        keep = []
        for req in self._doomed:
            if req.reads_in_flight:
                keep.append(req)
                continue
            self.store.free(req.local_items())
            req.where[...] = REMOTE
        self._doomed = keep

    def busy_peers(self) -> set[str]:
        """The peers with a read in flight (they get no new one until it settles)."""
        return {read.pending.peer for read in self._reads}

    @property
    def reads_in_flight(self) -> int:
        return len(self._reads)
