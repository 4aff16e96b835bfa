"""A tensor-parallel rank's model runner, and the loop every rank but 0 runs.

`ParallelModelRunner` is the engine's `ModelRunner` over the rank's shard: the model is
`ParallelLlamaForCausalLM`, and the config the runner sees (`model_config`) holds the rank's
query and KV heads, so its KV cache, sparse manager and host pool hold only those heads. The
host pool gets the rank's share of `--host-kv-gb`.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import replace

import torch

from oasiskv.config import EngineConfig
from oasiskv.distributed.group import ParallelGroup, init_group
from oasiskv.distributed.model import ParallelLlamaForCausalLM
from oasiskv.distributed.sharding import local_config, shard_plan
from oasiskv.distributed.step_input import RequestMirror
from oasiskv.engine.model_runner import ModelRunner, pick_device
from oasiskv.engine.sampler import read_host
from oasiskv.models.loader import ModelSource, iter_weights, skip_weight_init

POLL_S = 1.0  # how often an idle rank checks that rank 0 is still there


def rank_device(cfg: EngineConfig, rank: int) -> torch.device:
    device = pick_device(cfg.device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def rank_config(cfg: EngineConfig, rank: int) -> EngineConfig:
    """The settings one rank's runner runs under: its device, its share of the host pool; CUDA
    graphs are not captured yet (the collectives inside them are not set up)."""
    host_share = cfg.with_sparse(host_kv_gb=cfg.sparse.host_kv_gb / cfg.tensor_parallel_size)
    return replace(host_share, device=str(rank_device(cfg, rank)), enforce_eager=True)


def share_cpu_threads(size: int) -> None:
    """On CPU the ranks share the cores: more compute threads than cores would make every
    collective wait on a descheduled thread."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


class ParallelModelRunner(ModelRunner):
    def __init__(self, cfg: EngineConfig, group: ParallelGroup):
        self.group = group
        if rank_device(cfg, group.rank).type == "cpu":
            share_cpu_threads(group.size)
        super().__init__(rank_config(cfg, group.rank))

    def _model_source(self) -> ModelSource:
        whole = super()._model_source()
        self.whole_source = whole
        self.plan = shard_plan(whole.config, self.group.rank, self.group.size)
        return replace(whole, config=local_config(whole.config, self.plan))

    def _load_model(self) -> ParallelLlamaForCausalLM:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), skip_weight_init():
                model = ParallelLlamaForCausalLM(self.whole_source.config, self.plan, self.group)
        finally:
            torch.set_default_dtype(default_dtype)
        model.load_weights(iter_weights(self.whole_source, self.dtype, device=self.device))
        return model.eval().requires_grad_(False)

    def _num_pages(self) -> int:
        """Pages every rank can hold: the block manager (on rank 0) hands out page ids for all."""
        return self.group.min_int(super()._num_pages())


def read_launched(runner: ParallelModelRunner, in_flight) -> None:
    """A launched step's outputs, read as rank 0 reads them: the tokens are rank 0's, but a
    pipeline step's readout keeps this rank's sparse counters and transfer budget up."""
    if in_flight is None:
        return
    seqs, (_, host, ready) = in_flight
    values = read_host(host, ready)
    if runner.is_pipeline_batch(seqs):
        runner.sparse_runner.read_pipeline_decode(seqs, values)


def worker_main(rank: int, cfg: EngineConfig, port: int, conn) -> None:
    """Rank `rank` > 0: build the runner, say ready, then run each step rank 0 announces on
    `conn` until it says stop. An error goes back on `conn` before the process exits."""
    parent = os.getppid()
    try:
        device = rank_device(cfg, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = init_group(rank, cfg.tensor_parallel_size, port, device, cfg.distributed_timeout_s)
        runner = ParallelModelRunner(cfg, group)
        mirror = RequestMirror(runner)
        conn.send(("ready", None))
        in_flight = None
        while True:
            if not conn.poll(POLL_S):
                if os.getppid() != parent:
                    return  # rank 0 is gone
                continue
            if conn.recv() == "stop":
                return
            step = group.broadcast_object()
            batch = mirror.apply(step)
            if not step.launch:
                read_launched(runner, in_flight)
                in_flight = None
                runner.execute(batch)
                continue
            ids = None
            if step.device_ids is not None:
                ids = group.broadcast(torch.empty(step.device_ids, dtype=torch.long, device=runner.device))
            launched = runner.launch_decode(batch.seqs, ids)
            read_launched(runner, in_flight)  # the last step's, once this one is queued (as rank 0 reads)
            in_flight = batch.seqs, launched
    except BaseException:  # noqa: BLE001 - whatever stopped the rank goes to rank 0's error
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)
