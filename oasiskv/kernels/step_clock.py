"""Clock stamps inside a captured decode step: one-thread kernels that write the GPU's global
timer (ns) into a device tensor, so a step's foreground time and pipeline stall can be read
with its tokens, one step later, under async scheduling too. (CUDA events recorded inside a
graph are recorded again by the next replay, which async scheduling launches before this
step is read.) On CPU the stamp is the host's clock: the step runs in line there.
"""
from __future__ import annotations

import time

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

STAMPS = 3  # step start, foreground done (before the join), joined


def stamp(clock: torch.Tensor, index: int) -> None:
    """clock[index] = now, in ns, in stream order (on CUDA: when the device gets there)."""
    if clock.is_cuda and triton is not None:
        _stamp_kernel[(1,)](clock, index, num_warps=1)
    else:
        clock[index] = time.perf_counter_ns()


if triton is not None:

    @triton.jit
    def _stamp_kernel(clock_ptr, index):
        old = tl.load(clock_ptr + index)  # an operand for the asm (it reads none)
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [old], dtype=tl.int64,
                                        is_pure=False, pack=1)
        tl.store(clock_ptr + index, now)
