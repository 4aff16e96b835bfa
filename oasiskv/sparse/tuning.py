"""How the lookahead pipeline runs its step: grids, stages, fork point, stream priorities.

The defaults are what the engine runs; each was chosen by side-by-side step timings of
`bench decode` at batch 16 (docs/kernel_benchmarks.md, "Where the 16K step goes"), which
varies them (`dataclasses.replace`), as do the GPU scripts and tests.
"""
from __future__ import annotations

from dataclasses import dataclass

# Where in layer l the foreground hands its stages to the predict stream: after the attention,
# after the o_proj GEMM (its CTAs are placed first and the scan fills the SMs around them: pays
# once the scan is long), after the MLP, or before the attention ("epilogue": the draft query and
# the summaries are ready then; prediction and selection may run beside the attention, whose
# last wave leaves SMs idle, and the transfer still waits for it, as it overwrites slots the
# attention reads).
STAGE_FORKS = ("attention", "o_proj", "mlp", "epilogue")


@dataclass(frozen=True, slots=True)
class PipelineTuning:
    # Decode-kernel splits per (request, kv head) over a working set: S + K + W blocks is short,
    # so one program each and no merge launch (None: the kernel's choice).
    attention_splits: int | None = 1
    # The working-set attention's software-pipeline stages; None: 5 (two K/V tiles in flight)
    # where an SM has the shared memory for them, else the kernel's default.
    attention_stages: int | None = None
    # SMs the step's GEMMs (cuBLASLt) leave to the stages, so the transfer programs do not push
    # GEMM CTAs into a second wave; None: torch's BLAS settings as they are.
    gemm_sm_carveout: int | None = 8
    # The transfer kernel's grid: 4 programs of 16 items in flight and 32 warps. Each takes a whole
    # SM's register file (64 registers x 1,024 threads), so no attention program shares its SM.
    transfer_programs: int = 4
    transfer_items: int = 16
    transfer_warps: int = 32
    # The transfer stream's priority (torch's scale: lower is higher): the fetch's chain bounds the
    # step at 16K, and a higher priority lets its programs take SMs first as they free up.
    transfer_priority: int = -1
    # One of STAGE_FORKS, or None: by the scan's width (`pipeline.stages_fork`).
    stages_fork: str | None = None
    # Layers whose transfer opens the next step (`LookaheadPipeline.begin_step`); None: 2 when the
    # stages run on side streams, 0 in order.
    deferred_layers: int | None = None
    # The stages that run: 3 all; 2 predict + select; 1 predict; 0 none (summaries only, the
    # foreground's own cost). Below 3 the step is not a valid decode: benchmarks only.
    stages: int = 3
    # The narrowest prediction scan a captured step is built for (8K tokens at block 16); the
    # widths double from it (`pipeline.scan_buckets`).
    scan_bucket_blocks: int = 512
    # Run the stages on side streams; None: on CUDA.
    background: bool | None = None

    def __post_init__(self):
        if self.stages_fork is not None and self.stages_fork not in STAGE_FORKS:
            raise ValueError(f"stages_fork takes {' / '.join(STAGE_FORKS)}, not {self.stages_fork!r}")
        if not 0 <= self.stages <= 3:
            raise ValueError(f"stages takes 0 to 3, not {self.stages}")
