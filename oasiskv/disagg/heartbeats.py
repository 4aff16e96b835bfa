"""The decode instance's lease traffic to its prefill peers, on a thread of its own
(docs/disaggregation.md, "Lifetimes"): one batched heartbeat per prefill peer (`LeaseKeeper`)
and the releases of finished requests, batched per peer, over the prefill's HTTP routes
(`POST {url}/v1/disagg/heartbeat` and `/v1/disagg/release`, entrypoints/openai/disagg_routes.py).

The engine thread only queues (`hold`, `release`) and collects (`lost`): an HTTP call to a
slow or dead peer never holds up a decode step. A peer that does not answer a heartbeat
within `timeout_s` loses all its leases at once (`Lost.unreachable`).
"""
from __future__ import annotations

import json
import queue
import threading
import urllib.request
from dataclasses import dataclass

from oasiskv.disagg.leases import LeaseKeeper

TICK_S = 0.1  # how often the thread looks for due heartbeats and queued releases


@dataclass(frozen=True)
class Lost:
    url: str  # the prefill instance
    request_id: str  # its request id there
    unreachable: bool  # the peer did not answer (else: it no longer holds the lease)


def post_json(url: str, body: dict, timeout_s: float, headers: dict[str, str] | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


class LeaseHeartbeats:
    def __init__(self, name: str, timeout_s: float = 2.0, headers: dict[str, str] | None = None):
        """name: this decode instance, as the prefill's LeaseTable knows it; headers: sent with
        every call (the inter-role secret)."""
        self.name, self.timeout_s, self.headers = name, timeout_s, headers or {}
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._lost: queue.SimpleQueue = queue.SimpleQueue()
        self._unreachable: set[str] = set()
        self.keeper = LeaseKeeper(self._heartbeat)
        self.releases_sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-heartbeats", daemon=True)
        self._thread.start()

    # ---- the engine thread ----------------------------------------------------------------
    def hold(self, url: str, request_id: str, ttl_s: float) -> None:
        self._ops.put(("hold", url, request_id, ttl_s))

    def release(self, url: str, request_id: str) -> None:
        """Stop renewing and tell the peer it may free the extent now."""
        self._ops.put(("release", url, request_id, 0.0))

    def lost(self) -> list[Lost]:
        out = []
        while True:
            try:
                out.append(self._lost.get_nowait())
            except queue.Empty:
                return out

    def held(self) -> int:
        return self.keeper.held()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ---- its own thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            releases: dict[str, list[str]] = {}
            while True:
                try:
                    op, url, rid, ttl = self._ops.get_nowait()
                except queue.Empty:
                    break
                if op == "hold":
                    self.keeper.hold(url, rid, ttl)
                else:
                    self.keeper.drop(rid)
                    releases.setdefault(url, []).append(rid)
            for url, ids in releases.items():
                try:
                    post_json(f"{url}/v1/disagg/release", {"peer": self.name, "request_ids": ids}, self.timeout_s,
                              self.headers)
                    self.releases_sent += len(ids)
                except OSError:  # gone: its leases lapse on their own
                    pass
            self._unreachable.clear()
            for url, ids in self.keeper.beat().items():
                for rid in ids:
                    self._lost.put(Lost(url, rid, url in self._unreachable))

    def _heartbeat(self, url: str, request_ids: list[str]) -> list[str]:
        try:
            return post_json(f"{url}/v1/disagg/heartbeat", {"peer": self.name, "request_ids": request_ids},
                             self.timeout_s, self.headers)["lost"]
        except Exception:
            self._unreachable.add(url)
            raise
