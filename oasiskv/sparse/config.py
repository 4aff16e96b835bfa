"""Settings of sparse decode (docs/design.md): working-set shape, fetch cap, drafter, host pool."""
from __future__ import annotations

import math
from dataclasses import dataclass

from oasiskv.sparse.drafters import drafter_named
from oasiskv.sparse.fetch_budget import parse_fetch_budget

# Block summaries (oasiskv.sparse.summaries): auto (fp8 on CUDA, else the KV dtype), kv, fp8 e4m3.
SUMMARY_DTYPES = ("auto", "kv", "fp8")
# A request converts only once its context is at least this many times its working set
# (S + K + W blocks; at K = 128 and block size 16: 4,256 tokens): below that its sparse step
# reads about as many KV bytes as dense and adds the pipeline's work on top.
MIN_CONTEXT_PER_WORKING_SET = 2
# Under GPU-pool pressure (instead of a preemption) from 1.5 times the working set.
PRESSURE_CONTEXT_PER_WORKING_SET = 1.5
BASE_THRESHOLD = 4096  # the default threshold's lower bound


def auto_threshold(top_k_blocks: int, sink_blocks: int, window_blocks: int, block_size: int) -> int:
    """The default `--sparse-threshold`: BASE_THRESHOLD, or the conversion floor if higher."""
    floor = MIN_CONTEXT_PER_WORKING_SET * (sink_blocks + top_k_blocks + window_blocks) * block_size
    return max(BASE_THRESHOLD, floor)


@dataclass(slots=True)
class SparseConfig:
    enabled: bool = False
    top_k_blocks: int = 128  # K: selected blocks per (layer, kv head)
    sink_blocks: int = 1  # S: first blocks, always resident
    window_blocks: int = 4  # W: newest blocks, always resident (the last one fills)
    # Context tokens at which a request converts to sparse; None: `auto_threshold`, which
    # EngineConfig sets (it knows the block size).
    sparse_threshold: int | None = None
    fetch_ratio: float = 0.05  # C = ceil(ratio * K) new blocks per head per step; 1.0 = uncapped
    drafter: str = "self"  # a registered drafter's name (`sparse.drafters`)
    host_kv_gb: float = 4.0  # size of the pinned host arena holding sparse requests' full KV
    summary_dtype: str = "auto"  # block summaries: auto (fp8 on CUDA, else kv) | kv (the KV dtype) | fp8
    fetch_budget: str | float = "auto"  # bytes a step may move: auto | off | MB per step (`fetch_budget`)

    def __post_init__(self):
        if not self.enabled:
            return
        if self.top_k_blocks < 1:
            raise ValueError(f"--top-k-blocks must be >= 1, got {self.top_k_blocks}")
        if self.sink_blocks < 0:
            raise ValueError(f"--sink-blocks must be >= 0, got {self.sink_blocks}")
        if self.window_blocks < 2:
            # A block that fills must stay resident for the step whose lookahead already fetched
            # the next step's blocks: with one window block it would leave before its host copy exists.
            raise ValueError(f"--window-blocks must be >= 2 (the block being filled and the one "
                             f"before it), got {self.window_blocks}")
        if not 0 < self.fetch_ratio <= 1:
            raise ValueError(f"--fetch-ratio must be in (0, 1], got {self.fetch_ratio}")
        drafter_named(self.drafter)  # a registered drafter (`sparse.drafters.register`)
        if self.summary_dtype not in SUMMARY_DTYPES:
            raise ValueError(f"unknown --summary-dtype {self.summary_dtype!r}; choose one of {', '.join(SUMMARY_DTYPES)}")
        self.fetch_budget = parse_fetch_budget(self.fetch_budget)
        if self.host_kv_gb <= 0:
            raise ValueError(f"--host-kv-gb must be positive, got {self.host_kv_gb}")

    @property
    def fetch_cap(self) -> int:
        """C = max(1, ceil(fetch_ratio * K)): at most C new blocks per KV head per step."""
        return max(1, math.ceil(self.fetch_ratio * self.top_k_blocks))

    @property
    def working_set_blocks(self) -> int:
        return self.sink_blocks + self.top_k_blocks + self.window_blocks
