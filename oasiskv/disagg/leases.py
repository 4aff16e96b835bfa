"""Leases: how long the owner (the prefill instance) keeps a request's host extent for readers
(docs/disaggregation.md, "Lifetimes").

A transport cannot tell registered memory from reused memory (a read of a reused extent
returns whatever is there), so the owner frees an extent only when no reader can still read it:

  grant      the owner hands the request to a decode peer: the lease runs for `ttl_s`;
  heartbeat  the peer renews all its leases in one message, periodically; the answer names the
             ones it no longer holds (expired or unknown), whose requests the peer must fail;
  release    the peer is done (finished or aborted): the extent may go at once;
  expiry     not renewed within the TTL: the lease is void (no renewal brings it back), and the
             extent goes `grace_s` later, once a read posted just before expiry has timed out.

Frees happen only in `reap()`, called by the thread that owns the host pool; the other methods
only mark, under a lock, so an HTTP handler may call them. The reader's side of the protocol is
`LeaseKeeper`: it sends the batched heartbeats and says which leases were lost.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from oasiskv.disagg.transport import DEFAULT_READ_TIMEOUT_S

DEFAULT_TTL_S = 10.0
HEARTBEAT_FRACTION = 1 / 3  # a reader renews every third of the TTL, so one lost beat is harmless


@dataclass(slots=True)
class Lease:
    request_id: str
    peer: str
    expires: float  # monotonic seconds
    released: bool = False


class LeaseTable:
    """The owner's leases, one per request, each held by one peer."""

    def __init__(self, free: Callable[[str], None], ttl_s: float = DEFAULT_TTL_S,
                 grace_s: float = DEFAULT_READ_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        """free(request_id): give the request's extent back to the host pool."""
        self.free, self.ttl_s, self.grace_s, self.clock = free, ttl_s, grace_s, clock
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.expired_total = 0  # leases that ended by expiry, not release

    def grant(self, request_id: str, peer: str) -> float:
        """Lease the request's extent to `peer`; returns the TTL the peer must renew within."""
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} is already leased")
            self._leases[request_id] = Lease(request_id, peer, self.clock() + self.ttl_s)
        return self.ttl_s

    def claim(self, request_id: str, peer: str) -> bool:
        """The peer that admits the request takes a lease granted to no peer yet (`grant(request,
        "")`: the prefill instance does not know which decode instance will admit it), and
        renews it; False if the lease is gone or held by another peer."""
        now = self.clock()
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.released or lease.expires < now or lease.peer not in ("", peer):
                return False
            lease.peer, lease.expires = peer, now + self.ttl_s
            return True

    def heartbeat(self, peer: str, request_ids: list[str]) -> list[str]:
        """Renew the peer's leases on these requests; returns the ones it does not hold (expired,
        released, unknown, or held by another peer)."""
        now, lost = self.clock(), []
        with self._lock:
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is None or lease.peer != peer or lease.released or lease.expires < now:
                    lost.append(rid)
                else:
                    lease.expires = now + self.ttl_s
        return lost

    def release(self, request_id: str) -> bool:
        """The reader is done with the request; False if no live lease was held."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.released:
                return False
            lease.released = True
            return True

    def release_peer(self, peer: str) -> int:
        """Release every lease the peer holds (it said it is going away); returns how many."""
        with self._lock:
            held = [l for l in self._leases.values() if l.peer == peer and not l.released]
            for lease in held:
                lease.released = True
        return len(held)

    def reap(self) -> list[str]:
        """Free the extents of released leases, and of expired ones past their grace; returns
        their request ids."""
        now, gone = self.clock(), []
        with self._lock:
            for rid, lease in list(self._leases.items()):
                if lease.released or lease.expires + self.grace_s <= now:
                    if not lease.released:
                        self.expired_total += 1
                    del self._leases[rid]
                    gone.append(rid)
        for rid in gone:
            self.free(rid)
        return gone

    def held(self) -> int:
        """Leases not yet freed (live, or expired and in their grace)."""
        with self._lock:
            return len(self._leases)

    def holds(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases


class LeaseKeeper:
    """The reader's (decode side's) leases: one batched heartbeat per owner peer, every
    HEARTBEAT_FRACTION of the shortest TTL it holds there. `send(peer, request_ids)` carries a
    heartbeat and returns the ids the owner no longer holds; if it raises, every lease of that
    peer counts as lost (the owner is unreachable, so its leases will lapse)."""

    def __init__(self, send: Callable[[str, list[str]], list[str]], clock: Callable[[], float] = time.monotonic):
        self.send, self.clock = send, clock
        self._held: dict[str, dict[str, float]] = {}  # peer -> {request_id: ttl_s}
        self._due: dict[str, float] = {}  # peer -> when its next heartbeat is due
        self.heartbeats = 0

    def hold(self, peer: str, request_id: str, ttl_s: float) -> None:
        self._held.setdefault(peer, {})[request_id] = ttl_s
        due = self.clock() + ttl_s * HEARTBEAT_FRACTION
        self._due[peer] = min(self._due.get(peer, due), due)

    def drop(self, request_id: str) -> None:
        """Stop renewing (the request is done: the caller releases it at the owner)."""
        for peer, held in list(self._held.items()):
            if held.pop(request_id, None) is not None and not held:
                del self._held[peer], self._due[peer]

    def beat(self) -> dict[str, list[str]]:
        """Send the heartbeats that are due; returns {peer: lost request ids}, which stop being
        renewed here (their requests must fail)."""
        now, lost = self.clock(), {}
        for peer, held in list(self._held.items()):
            if self._due[peer] > now:
                continue
            ids = list(held)
            self.heartbeats += 1
            try:
                gone = self.send(peer, ids)
            except Exception:  # noqa: BLE001 - an unreachable owner: its leases lapse
                gone = ids
            for rid in gone:
                held.pop(rid, None)
            if gone:
                lost[peer] = list(gone)
            if held:
                self._due[peer] = now + min(held.values()) * HEARTBEAT_FRACTION
            else:
                del self._held[peer], self._due[peer]
        return lost

    def held(self) -> int:
        return sum(len(h) for h in self._held.values())
