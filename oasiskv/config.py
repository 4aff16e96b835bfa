"""Engine settings (the flag names follow vLLM's where one exists). Sparse decode's settings are a
nested `SparseConfig`, as vLLM nests its configs; users and the CLI pass them as flat keywords
(`LLM(model, sparse=True, top_k_blocks=32)`), which `EngineConfig.from_flat` maps."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from oasiskv.sparse.config import SparseConfig, auto_threshold
from oasiskv.sparse.drafters import drafter_named
from oasiskv.sparse.tuning import PipelineTuning

# The flat keyword of each SparseConfig field: `sparse` turns it on, the others keep their names.
SPARSE_FLAGS = {"sparse": "enabled"} | {f.name: f.name for f in fields(SparseConfig) if f.name != "enabled"}


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF dir, .gguf file, downloaded or preset name; None = embedded SmolLM2-135M
    load_format: str = "auto"  # auto | dummy
    rope_scaling: dict | None = None  # over the model's own, e.g. YaRN {"rope_type": "yarn", "factor": 4.0, ...}
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096  # prefill chunk budget per step (docs/benchmarks.md: why)
    kv_cache_gb: float | None = None  # explicit KV pool size
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    max_cuda_graph_batch: int = 256
    sparse: SparseConfig = field(default_factory=SparseConfig)  # sparse decode, off by default
    # A decode instance (serve --role decode): GiB of host arena for its admitted requests' items
    # (`disagg.LocalItems`; pinned and mapped for the pipeline); None elsewhere.
    remote_kv_gb: float | None = None
    # Decode role: the remote reads a step asks per (layer, KV head), its best-ranked misses;
    # None: the fetch cap C (what the selection admits a step), 0: every predicted block.
    rpf_want_per_head: int | None = None
    # How the pipeline runs its step (grids, stages, streams): not a flag; benchmarks and tests vary it.
    pipeline_tuning: PipelineTuning = field(default_factory=PipelineTuning)
    enable_prefix_caching: bool = True  # share cached leading blocks between requests (vLLM v1's default)
    async_scheduling: str = "auto"  # decode step t+1 launched before step t's tokens are read: auto (CUDA) | on | off
    tensor_parallel_size: int = 1  # ranks (processes, one device each) the model is split over
    distributed_timeout_s: float = 300.0  # the longest a collective between ranks may wait

    @classmethod
    def from_flat(cls, **kwargs) -> EngineConfig:
        """An EngineConfig from flat keywords: EngineConfig's fields, and SparseConfig's by their
        SPARSE_FLAGS names."""
        unknown = sorted(set(kwargs) - set(SPARSE_FLAGS) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        sparse = {name: kwargs.pop(flag) for flag, name in SPARSE_FLAGS.items() if flag in kwargs}
        return cls(**kwargs, sparse=SparseConfig(**sparse))

    def __post_init__(self):
        s = self.sparse
        if s.sparse_threshold is None:  # the one default: it depends on the block size, set here
            self.sparse = replace(s, sparse_threshold=auto_threshold(s.top_k_blocks, s.sink_blocks, s.window_blocks,
                                                                     self.block_size))
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size must be 8, 16, 32 or 64, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"async_scheduling must be auto, on or off, got {self.async_scheduling!r}")
        drafter_named(self.sparse.drafter)  # an unknown name fails here
        if self.tensor_parallel_size > 1:
            self._check_parallel()
        sc = self.sparse
        if sc.enabled and sc.sparse_threshold <= (sc.sink_blocks + sc.window_blocks) * self.block_size:
            raise ValueError(f"--sparse-threshold {sc.sparse_threshold} must exceed the sink and window "
                             f"blocks ({sc.sink_blocks} + {sc.window_blocks}) x block size {self.block_size}")

    def _check_parallel(self) -> None:
        drafter = drafter_named(self.sparse.drafter)
        if not drafter.runs_with_tensor_parallel:
            raise ValueError(f"the {drafter.name} drafter does not run with --tensor-parallel-size > 1")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}")

    def with_sparse(self, **changes) -> EngineConfig:
        """A copy whose SparseConfig has these fields changed (e.g. `enabled=True, top_k_blocks=64`)."""
        return replace(self, sparse=replace(self.sparse, **changes))

    def want_per_head(self) -> int:
        """A decode instance's remote reads per (layer, KV head) and step (0: every predicted block)."""
        if self.rpf_want_per_head is not None:
            if self.rpf_want_per_head < 0:
                raise ValueError(f"--rpf-want-per-head must be >= 0, got {self.rpf_want_per_head}")
            return self.rpf_want_per_head
        return self.sparse.fetch_cap
