"""Transport read rate between two processes on this host (docs/disaggregation.md):

    python -m oasiskv.disagg.bench --transport socket|nixl [--reads 4096] [--item-kib 8] [--run 1]

An owner process registers a region of patterned bytes and serves it; this process reads
`--reads` scattered extents of `--run` adjacent items each (run 1: single 8 KiB items, as a
(block, KV head) item; run = Hkv: a block's heads of one layer, adjacent in the host layout)
into its own region, `--repeat` times, verifies every byte of the last read, and prints the
median and best time and rate.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np
import torch


def pattern(n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.int32)
    return ((i * 7 + i // 251) % 256).to(torch.uint8)


def make(kind: str):
    if kind == "nixl":
        from oasiskv.disagg.nixl_transport import NixlTransport  # noqa: PLC0415
        return NixlTransport()
    from oasiskv.disagg.socket_transport import SocketTransport  # noqa: PLC0415
    return SocketTransport()


def owner(kind: str, nbytes: int) -> None:
    region = pattern(nbytes)
    t = make(kind)
    t.register(region)
    t.serve()
    print(json.dumps({"metadata": t.metadata().decode()}), flush=True)
    sys.stdin.readline()  # until the reader is done
    t.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", choices=["socket", "nixl"], default="socket")
    ap.add_argument("--reads", type=int, default=4096, help="extents per batched read")
    ap.add_argument("--item-kib", type=int, default=8)
    ap.add_argument("--run", type=int, default=1, help="adjacent items per extent")
    ap.add_argument("--region-mib", type=int, default=128, help="the owner's region")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--owner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    region_bytes = args.region_mib << 20
    if args.owner:
        return owner(args.transport, region_bytes)
    proc = subprocess.Popen([sys.executable, "-m", "oasiskv.disagg.bench", "--owner", "--transport", args.transport,
                             "--region-mib", str(args.region_mib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("{"):
            line = proc.stdout.readline()
        md = json.loads(line)["metadata"].encode()
        extent = args.item_kib * 1024 * args.run
        slots = region_bytes // extent
        rng = np.random.default_rng(0)
        remote = rng.choice(slots, size=args.reads, replace=False) * extent
        local_region = torch.zeros(args.reads * extent, dtype=torch.uint8)
        t = make(args.transport)
        t.register(local_region)
        peer = t.add_peer(md)
        extents = np.stack([remote, np.full(args.reads, extent)], 1)
        local = np.arange(args.reads) * extent
        times, posts = [], []
        for _ in range(args.repeat + 1):  # the first sets up the connection
            start = time.perf_counter()
            pending = t.read(peer, extents, local, timeout_s=30)
            posts.append(time.perf_counter() - start)
            t.wait(pending, spin_s=0.0001)
            times.append(time.perf_counter() - start)
        times, posts = times[1:], posts[1:]
        src = pattern(region_bytes)
        for off, dst in zip(remote.tolist(), local.tolist()):
            if not torch.equal(local_region[dst:dst + extent], src[off:off + extent]):
                raise SystemExit(f"bytes differ at remote offset {off}")
        nbytes = args.reads * extent
        med, best = statistics.median(times), min(times)
        print(f"{args.transport}: {args.reads} reads of {extent // 1024} KiB ({nbytes / 2**20:.0f} MiB), "
              f"median {med * 1e3:.1f} ms = {nbytes / med / 1e9:.2f} GB/s, best {best * 1e3:.1f} ms = "
              f"{nbytes / best / 1e9:.2f} GB/s, bytes verified; posting it took {statistics.median(posts) * 1e3:.2f} ms "
              f"(the caller's share)")
        t.close()
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
