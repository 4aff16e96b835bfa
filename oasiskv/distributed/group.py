"""The ranks' process groups and the few collectives tensor parallelism needs.

Every rank holds one `ParallelGroup`: a group for the model's tensors (NCCL on CUDA, Gloo on
CPU) and a Gloo group for the step inputs rank 0 sends (pickled objects, on the host). The
groups are built from a TCP store, outside torch.distributed's global default group, so a
process may hold several engines. Every collective waits at most `timeout`: a rank that died
or hangs turns into a `RankFailure` on the others, never a silent hang.
"""
from __future__ import annotations

import pickle
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


START_TIMEOUT_S = 600.0  # ranks import torch and load their shard before the first collective


class RankFailure(RuntimeError):
    """A collective between the tensor-parallel ranks failed or timed out."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ParallelGroup:
    rank: int
    size: int
    device_group: dist.ProcessGroupNCCL | dist.ProcessGroupGloo  # collectives on the model's tensors
    cpu_group: dist.ProcessGroupGloo  # step inputs and host integers
    timeout: timedelta

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (row-parallel layers)."""
        self._wait("all_reduce", self.device_group.allreduce([x]))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` joined along the last dimension, in rank order (vocab-parallel logits)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._wait("all_gather", self.device_group.allgather([parts], [x.contiguous()]))
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x`, in place, on the device (async scheduling's
        inputs: rank 0's samples, never read by the host)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait("broadcast", self.device_group.broadcast([x], opts))
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (a KV pool size all ranks can hold); called
        while the ranks load, so it waits up to the start-up timeout."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        opts.timeout = timedelta(seconds=max(START_TIMEOUT_S, self.timeout.total_seconds()))
        self._wait("min_int", self.cpu_group.allreduce([t], opts))
        return int(t.item())

    def broadcast_object(self, obj=None):
        """Rank 0's `obj`, pickled, on every rank (the others pass nothing)."""
        size = torch.zeros(1, dtype=torch.int64)
        data = None
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size[0] = data.numel()
        self._broadcast("broadcast_object", size)
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast("broadcast_object", data)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def _broadcast(self, op: str, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(op, self.cpu_group.broadcast([t], opts))

    def _wait(self, op: str, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise RankFailure(f"tensor-parallel {op} failed on rank {self.rank} of {self.size} "
                              f"(timeout {self.timeout.total_seconds():g} s): {e}") from e


def init_group(rank: int, size: int, port: int, device: torch.device, timeout_s: float) -> ParallelGroup:
    """Joins the ranks through a TCP store on 127.0.0.1:port that rank 0 hosts (one host)."""
    timeout = timedelta(seconds=timeout_s)
    start = timedelta(seconds=max(START_TIMEOUT_S, timeout_s))
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=start)
    cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, size, timeout)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        device_group = dist.ProcessGroupNCCL(dist.PrefixStore("device", store), rank, size, opts)
    else:
        device_group = dist.ProcessGroupGloo(dist.PrefixStore("device", store), rank, size, timeout)
    return ParallelGroup(rank, size, device_group, cpu_group, timeout)
