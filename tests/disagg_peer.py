"""An owner process for the disaggregation tests: a host pool registered with a transport, its
bytes a known pattern, and a lease table, driven by one-line commands on stdin.

    python tests/disagg_peer.py TRANSPORT SEED NUM_ITEMS

prints {"metadata": ...} once, then answers each command with one JSON line:
    alloc RID BLOCKS          an extent of BLOCKS blocks (1 layer, 2 heads) -> its byte range
    lease RID PEER TTL GRACE  grant a lease on RID's extent
    beat PEER RID...          renew -> the ids PEER no longer holds
    release RID               the reader is done
    used                      host pool bytes used and leases held
    exit
Leases are reaped every 20 ms by a background thread, as the engine's loop would.
"""
from __future__ import annotations

import json
import sys
import threading
import time

import torch

from oasiskv.disagg.leases import LeaseTable
from oasiskv.sparse.host_pool import HostKVPool

BLOCK_SIZE, HEAD_DIM, HEADS = 16, 64, 2


def pattern(seed: int, start: int, n: int) -> torch.Tensor:
    """Bytes [start, start + n) of the pattern of owner `seed` (the test's reference)."""
    i = torch.arange(start, start + n, dtype=torch.int64)
    return ((i * 7 + i // 251 + seed * 13) % 256).to(torch.uint8)


def make_transport(name: str):
    if name == "nixl":
        from oasiskv.disagg.nixl_transport import NixlTransport
        return NixlTransport()
    from oasiskv.disagg.socket_transport import SocketTransport
    return SocketTransport()


def main() -> None:
    kind, seed, num_items = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    pool = HostKVPool(0, BLOCK_SIZE, HEAD_DIM, torch.bfloat16, pin=False, num_items=num_items)
    region = pool.items.view(-1).view(torch.uint8)
    region.copy_(pattern(seed, 0, region.numel()))
    transport = make_transport(kind)
    transport.register(pool.items)
    transport.serve()
    lock = threading.Lock()
    leases = LeaseTable(pool.free)

    def reap_forever() -> None:
        while True:
            with lock:
                leases.reap()
            time.sleep(0.02)

    threading.Thread(target=reap_forever, daemon=True).start()
    print(json.dumps({"metadata": transport.metadata().decode()}), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        with lock:
            if cmd == "alloc":
                ext = pool.allocate(args[0], 1, int(args[1]), HEADS)
                out = {"offset": ext.start * pool.item_bytes, "nbytes": ext.num_items * pool.item_bytes}
            elif cmd == "lease":
                leases.ttl_s, leases.grace_s = float(args[2]), float(args[3])
                out = {"ttl": leases.grant(args[0], args[1])}
            elif cmd == "beat":
                out = {"lost": leases.heartbeat(args[0], args[1:])}
            elif cmd == "release":
                out = {"released": leases.release(args[0])}
            elif cmd == "used":
                out = {"used": pool.bytes_used, "leases": leases.held()}
            elif cmd == "exit":
                break
            else:
                out = {"error": f"unknown command {cmd}"}
        print(json.dumps(out), flush=True)
    transport.close()


if __name__ == "__main__":
    main()
