"""Rank 0 of a tensor-parallel engine: starts the other ranks and drives them, as vLLM's
multiprocessing executor does.

`DriverRunner` is the engine's model runner on rank 0. It starts one process per other rank
(`worker.worker_main`), and before each step wakes them through a pipe and broadcasts the
step's `StepInput`; then every rank runs the same batch, and the engine reads rank 0's tokens.
Ranks wait for a step on their pipe, not in a collective, so an idle engine never times out.
A rank that dies or hangs fails the next collective within `--distributed-timeout-s`; the
engine then raises a `RankFailure` naming the ranks and why they stopped.
"""
from __future__ import annotations

import multiprocessing as mp
import time
import weakref

import torch

from oasiskv.config import EngineConfig
from oasiskv.distributed.group import START_TIMEOUT_S, RankFailure, free_port, init_group
from oasiskv.distributed.step_input import StepInputBuilder
from oasiskv.distributed.worker import ParallelModelRunner, rank_device, worker_main
from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.engine.sequence import Sequence


class RankProcesses:
    """The processes of ranks 1..N-1 and the pipe to each; each runs
    `target(rank, cfg, port, pipe, *target_args)` (default: the engine's rank loop)."""

    def __init__(self, cfg: EngineConfig, port: int, target=worker_main, target_args: tuple = ()):
        ctx = mp.get_context("spawn")  # CUDA cannot be forked; spawn also keeps the ranks clean
        self.procs, self.conns, self.errors = [], [], {}
        self.failed = False  # after a failure the healthy ranks sit in a broken collective: no waiting on them
        for rank in range(1, cfg.tensor_parallel_size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=target, args=(rank, cfg, port, theirs, *target_args),
                            name=f"oasiskv-tp-rank{rank}")
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)

    def wait_ready(self, timeout_s: float) -> None:
        """Every rank has built its runner, or a RankFailure: one died, or none answered in time."""
        waiting = set(range(len(self.conns)))
        deadline = time.monotonic() + timeout_s
        while waiting:
            for i in list(waiting):
                kind, _ = self._receive(i, wait_s=0.05)
                if kind == "ready":
                    waiting.discard(i)
                elif kind != "none":
                    raise self.failure(f"rank {i + 1} failed to start")
                elif not self.procs[i].is_alive():
                    raise self.failure(f"rank {i + 1} exited while starting")
            if waiting and time.monotonic() > deadline:
                raise self.failure(f"ranks {sorted(r + 1 for r in waiting)} did not start within {timeout_s:g} s")

    def wake(self) -> None:
        """Tell every rank a step's input follows (a few bytes: never blocks on a hung rank)."""
        for i, conn in enumerate(self.conns):
            try:
                conn.send("step")
            except OSError:
                raise self.failure(f"rank {i + 1} is gone") from None

    def failure(self, what: str) -> RankFailure:
        """What happened to every rank that stopped, as one error."""
        self.failed = True
        for i in range(len(self.conns)):
            while self._receive(i, wait_s=0)[0] not in ("gone", "none"):
                pass
        notes = []
        for i, p in enumerate(self.procs):
            if i + 1 in self.errors:
                notes.append(f"rank {i + 1} raised:\n{self.errors[i + 1]}")
            elif p.exitcode is not None:
                notes.append(f"rank {i + 1} exited with code {p.exitcode}")
        alive = [i + 1 for i, p in enumerate(self.procs) if p.is_alive()]
        if alive:  # a hung rank, or one still waiting in the broken collective
            notes.append(f"still running: rank {', '.join(map(str, alive))}")
        return RankFailure("tensor parallelism: " + what + ("; " + "; ".join(notes) if notes else ""))

    def _receive(self, i: int, wait_s: float | None = None):
        """Rank i+1's next message: ("ready" | "error", text), ("none", None) if none came within
        wait_s, ("gone", None) once its end is closed."""
        try:
            if wait_s is not None and not self.conns[i].poll(wait_s):
                return "none", None
            kind, text = self.conns[i].recv()
        except (EOFError, OSError):
            return "gone", None
        if kind == "error":
            self.errors[i + 1] = text
        return kind, text

    def stop(self, wait_s: float = 10.0) -> None:
        for conn in self.conns:
            try:
                conn.send("stop")
            except OSError:
                pass
        deadline = time.monotonic() + (0.0 if self.failed else wait_s)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


class DriverRunner(ParallelModelRunner):
    def __init__(self, cfg: EngineConfig):
        port = free_port()
        device = rank_device(cfg, 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.ranks = RankProcesses(cfg, port)
        self._stopper = weakref.finalize(self, self.ranks.stop)
        self.steps = StepInputBuilder()
        try:
            group = init_group(0, cfg.tensor_parallel_size, port, device, cfg.distributed_timeout_s)
            super().__init__(cfg, group)
            if self.pipeline is not None:
                self._record_pipeline_leaves()
            self.ranks.wait_ready(max(START_TIMEOUT_S, cfg.distributed_timeout_s))
        except RankFailure as e:
            error = self._failure(e)
            self.shutdown()
            raise error from e
        except BaseException:
            self.shutdown()
            raise

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        try:
            self.ranks.wake()
            self.group.broadcast_object(self.steps.build(batch))
            return super().execute(batch)
        except RankFailure as e:
            raise self._failure(e) from e

    def launch_decode(self, seqs: list[Sequence], ids: torch.Tensor | None = None):
        """A decode step that does not wait for its tokens (async scheduling), on every rank:
        `ids`, rank 0's samples still on the device, go to the others' devices first."""
        try:
            self.ranks.wake()
            batch = ScheduledBatch(seqs, [1] * len(seqs), False)
            shape = None if ids is None else tuple(ids.shape)
            self.group.broadcast_object(self.steps.build(batch, device_ids=shape, launch=True))
            if ids is not None:
                ids = self.group.broadcast(ids.contiguous())
            return super().launch_decode(seqs, ids)
        except RankFailure as e:
            raise self._failure(e) from e

    def _record_pipeline_leaves(self) -> None:
        """Every request that leaves a pipeline row here (the scheduler finishes or preempts it)
        is told to the other ranks, in order with the conversions, so their rows stay rank 0's."""
        leave = self.sparse.leave_pipeline

        def leave_and_record(seq: Sequence) -> None:
            if seq.sparse is not None and seq.sparse.row is not None:
                self.steps.record_leave(seq)
            leave(seq)
        self.sparse.leave_pipeline = leave_and_record

    def _failure(self, e: RankFailure) -> RankFailure:
        """A collective's failure, with what happened to each rank (once: `RankProcesses.failure`
        may have said it already)."""
        return e if self.ranks.failed else self.ranks.failure(str(e))

    def convert_to_sparse(self, seq: Sequence, last_q: torch.Tensor, pages: list[int], summary_run: list[int]) -> None:
        self.steps.record_conversion(seq, pages, summary_run)  # the other ranks convert before the next step
        super().convert_to_sparse(seq, last_q, pages, summary_run)

    def shutdown(self) -> None:
        """Stop the other ranks (also done when the runner is collected or the process exits)."""
        self._stopper()
