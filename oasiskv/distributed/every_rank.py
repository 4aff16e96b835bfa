"""One function run by every rank at once, each over its own shard (as torchrun runs a script).

`bench decode` drives a model runner directly, without the engine's scheduler, so at size N
it runs whole on every rank: the same arguments make every rank take the same branches and so
meet in the same collectives, each rank filling and timing its own shard. Rank 0 is the
calling process and returns its result; the other ranks are spawned, their output silenced.
"""
from __future__ import annotations

import os
import sys
import traceback

import torch

from oasiskv.config import EngineConfig
from oasiskv.distributed.executor import RankProcesses
from oasiskv.distributed.group import RankFailure, free_port, init_group
from oasiskv.distributed.worker import rank_device


def run_on_every_rank(cfg: EngineConfig, fn, *args):
    """fn(group, *args) on each of the cfg.tensor_parallel_size ranks; rank 0's result. fn
    must be importable by name (the ranks are spawned). A rank that fails or hangs raises a
    RankFailure here, naming it."""
    port = free_port()
    ranks = RankProcesses(cfg, port, target=_rank_main, target_args=(fn, args))
    try:
        device = rank_device(cfg, 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = init_group(0, cfg.tensor_parallel_size, port, device, cfg.distributed_timeout_s)
        return fn(group, *args)
    except RankFailure as e:
        raise (e if ranks.failed else ranks.failure(str(e))) from e
    finally:
        ranks.stop()


def _rank_main(rank: int, cfg: EngineConfig, port: int, conn, fn, args) -> None:
    try:
        device = rank_device(cfg, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        sys.stdout = open(os.devnull, "w")  # rank 0 prints the results
        fn(init_group(rank, cfg.tensor_parallel_size, port, device, cfg.distributed_timeout_s), *args)
        conn.send(("done", None))
    except BaseException:  # noqa: BLE001 - whatever stopped the rank goes to rank 0's error
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)
