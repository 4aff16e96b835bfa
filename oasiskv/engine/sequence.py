"""A request as the engine tracks it: tokens, pages, state and timing."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from oasiskv.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from oasiskv.engine.penalties import TokenCounts
    from oasiskv.engine.structured_output import RequestGrammar
    from oasiskv.sparse.host_cache import HostHit
    from oasiskv.sparse.host_pool import HostExtent
    from oasiskv.sparse.working_set import WorkingSet

PENDING = -1  # an output token still on the device (async scheduling), never seen outside a step


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    pages: list[int] = field(default_factory=list)  # page table: logical block -> page
    num_cached_tokens: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    stop_text_len: int | None = None  # where a stop string cut the text
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None  # when it first got a place in a batch
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # for seeded sampling
    sparse: WorkingSet | None = None  # once the request decodes sparse
    host_extent: HostExtent | None = None  # its reservation in the host KV pool
    # A prompt that converts when its prefill ends: its leading blocks already copied to the host
    # extent, and the prompt position the copies reached (oasiskv.sparse.prefill_copies).
    prefill_blocks_on_host: int = 0
    prefill_copied_to: int = 0
    convert_early: bool = False  # the scheduler converts it to sparse now, instead of a preemption
    hand_over: bool = False  # a prefill instance converts it whatever its length (oasiskv.disagg.prefill_engine)
    # Its prompt is longer than the GPU pool: prefilled with its K/V in the host pool alone, its
    # pages a staging run (oasiskv.sparse.streamed_prefill); sparse from its first chunk.
    streamed: bool = False
    # What sampling records and needs (oasiskv.engine.logprobs, oasiskv.engine.penalties):
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, if asked
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)  # if asked
    min_tokens_stop_ids: list[int] = field(default_factory=list)  # masked until min_tokens exist
    token_counts: TokenCounts | None = None  # for penalties
    grammar: RequestGrammar | None = None  # structured output: advanced by each generated token
    error: str | None = None  # its own work (sampling, stop check, output) failed: why
    # Prefix cache (oasiskv.engine.block_manager): names of its full blocks so far, how many of its
    # pages the cache knows by name, and its prompt tokens found cached when it was first admitted
    # (both tiers; of those, the host tier's). Host tier (oasiskv.sparse.host_cache): a hit
    # admitted but not yet loaded into its pages, and the hit blocks' summaries until it converts.
    block_names: list[bytes] = field(default_factory=list)
    num_named_blocks: int = 0
    prefix_hit_tokens: int | None = None
    host_hit_tokens: int | None = None
    host_load: HostHit | None = None
    host_summaries: tuple | None = None
    _page_cache: tuple | None = field(default=None, repr=False)  # (the list, its int64 array)

    @property
    def last_token_id(self) -> int:
        """The newest token, without building `token_ids` (a copy of the whole context: at 32K
        tokens and batch 16 that copy alone cost a decode step 3 ms of host time)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def page_array(self) -> np.ndarray:
        """`pages` as an int64 array, extended as pages are appended instead of rebuilt every
        step (converting a 2K-entry list per request per step was most of a dense step's batch
        building at 32K). The block manager only appends to a sequence's list or replaces it."""
        cached = self._page_cache
        if cached is None or cached[0] is not self.pages or len(cached[1]) > len(self.pages):
            arr = np.array(self.pages, dtype=np.int64)
        else:
            arr = cached[1]
            if len(arr) < len(self.pages):
                arr = np.concatenate([arr, np.array(self.pages[len(arr):], dtype=np.int64)])
        self._page_cache = (self.pages, arr)
        return arr

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without copying the whole context."""
        p = self.prompt_token_ids
        if end <= len(p):
            return p[start:end]
        return p[start:] + self.output_token_ids[max(0, start - len(p)):end - len(p)]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """More than the newest token still needs its K/V computed (fresh or preempted)."""
        return self.num_uncached > 1 or not self.output_token_ids
