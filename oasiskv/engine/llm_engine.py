"""The engine loop: schedule -> run -> postprocess, plus request intake and outputs."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from oasiskv.config import EngineConfig
from oasiskv.engine.block_hash import engine_salt
from oasiskv.engine.block_manager import BlockManager
from oasiskv.engine.memory_plan import gpu_bytes_by_kind
from oasiskv.engine.model_runner import ModelRunner
from oasiskv.engine.sampler import on_device, read_host
from oasiskv.engine.scheduler import ScheduledBatch, Scheduler
from oasiskv.engine.sequence import PENDING, Sequence, SequenceStatus
from oasiskv.engine.structured_output import Grammars
from oasiskv.models.step_bytes import experts_touched_bound, kv_bytes_per_step, weight_bytes_per_step
from oasiskv.models.tokenizer import load_tokenizer
from oasiskv.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A decode step launched but not yet read back. A batch with grammars launches its forward
    first and is sampled once the step before has been read (`sample`): each mask needs the
    grammar advanced by that step's token, and the host builds the masks while the device runs
    the forward."""
    batch: ScheduledBatch
    tokens: torch.Tensor | None  # sampled, on the device (sparse pipeline rows: [n, 2] token, next draft)
    host_tokens: torch.Tensor | None  # their copy in pinned host memory, complete once `ready` fires
    ready: torch.cuda.Event | None  # None on CPU
    launched: float
    runner: ModelRunner | None = None  # set for a batch of sparse pipeline rows, whose pairs it reads
    logits: torch.Tensor | None = None  # launched and not yet sampled (`sample`)

    @classmethod
    def launch(cls, runner, batch: ScheduledBatch, ids: torch.Tensor | None = None,
               defer_sampling: bool = False) -> "InFlight":
        if defer_sampling:
            return cls(batch, None, None, None, time.perf_counter(), logits=runner.launch_logits(batch.seqs, ids))
        pipeline = runner.is_pipeline_batch(batch.seqs)
        return cls(batch, *runner.launch_decode(batch.seqs, ids), time.perf_counter(),
                   runner if pipeline else None)

    def sample(self, runner: ModelRunner) -> None:
        self.tokens, self.host_tokens, self.ready = runner.sample_launched(self.logits, self.batch.seqs)
        self.logits = None

    def read(self) -> list[int]:
        values = read_host(self.host_tokens, self.ready)
        if self.runner is not None:
            return self.runner.sparse_runner.read_pipeline_decode(self.batch.seqs, values)
        return values


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # once finished (the engine detokenizes at the end; the server streams its own text)
    token_ids: list[int]
    finish_reason: str | None
    finished: bool
    metrics: dict = field(default_factory=dict)  # queue/prefill/decode time, ttft, tpot, e2el (s), preemptions
    stats: dict = field(default_factory=dict)
    # Asked for with SamplingParams.logprobs / prompt_logprobs (else None): per generated token,
    # {token id: logprob} holding it and the top-n; per prompt token the same, [0] is None.
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cumulative_logprob: float | None = None  # the sum of the generated tokens' logprobs
    error: str | None = None  # the request's own work failed (finish_reason "error"): why
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (vLLM's name)
    num_host_cached_tokens: int | None = None  # of those, found in its host tier (sparse engines)


def _parallel_runner(config: EngineConfig) -> ModelRunner:
    from oasiskv.distributed.executor import DriverRunner  # size 1 never imports it

    return DriverRunner(config)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config) if config.tensor_parallel_size == 1 else _parallel_runner(config)
        self.tokenizer = load_tokenizer(self.runner.source)
        mc = self.runner.model_config
        # What besides the tokens decides a block's K/V: the root of every block name.
        salt = engine_salt(mc.name, config.model, config.load_format, config.rope_scaling,
                           config.seed if config.load_format == "dummy" else None, str(self.runner.dtype),
                           config.block_size)
        self.block_manager = BlockManager(self.runner.num_pages, config.block_size, config.enable_prefix_caching,
                                          salt)
        if self.runner.sparse is not None and config.tensor_parallel_size == 1:  # (ranks mirror host extents)
            self.block_manager.host_tier = self.runner.sparse.enable_host_tier()
        self.max_model_len = self.runner.max_model_len
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.runner.sparse, self.max_model_len)
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, sorted(self.eos_token_ids))
        self._ids = itertools.count()
        # A decode instance (remote_kv_gb) steps synchronously: the host reads each step's wanted
        # blocks before it prepares the next (`disagg.decode_side.RemoteSource`).
        self.async_scheduling = config.remote_kv_gb is None and (config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and self.runner.device.type == "cuda"))
        self._in_flight: InFlight | None = None
        self._last_done = 0.0
        self._weight_bytes: dict[int, int] = {}  # batch size -> weight bytes a decode step reads
        self.seqs: dict[str, Sequence] = {}
        # True: a finished output carries its text (unfinished ones carry token ids only). False:
        # no text and stop strings are not checked (a front end that detokenizes off the engine's
        # thread does both); stop tokens and lengths still apply.
        self.detokenize = True
        self.step_stats = {"prefill_steps": 0, "decode_steps": 0, "decode_time": 0.0,
                           "decode_tokens": 0, "prefill_time": 0.0, "prefill_tokens": 0,
                           "decode_bytes": 0, "overlapped_steps": 0}

    # ---- intake -------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (dummy weights): pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.runner.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt is {len(token_ids)} tokens, longer than the maximum model length "
                             f"{self.max_model_len} minus one token of output")
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        if params.top_k > vocab:
            raise ValueError(f"top_k must be at most the vocabulary size {vocab}, got {params.top_k}")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {max(params.logit_bias)}")
        sparse, num_pages = self.runner.sparse, self.block_manager.num_pages
        probe = Sequence("", token_ids, params)
        pages = -(-(len(token_ids) + 1) // self.config.block_size)
        if pages > num_pages and sparse is None:
            raise ValueError(f"the prompt needs {pages} KV pages but the cache holds only {num_pages}; raise "
                             f"--kv-cache-gb, or serve it with --sparse (prefilled through the host pool)")
        if sparse is not None and sparse.streams_prefill(probe, num_pages):  # prefill beyond HBM
            if self.config.tensor_parallel_size > 1:
                raise ValueError(f"the prompt needs {pages} KV pages but the cache holds only {num_pages}, and "
                                 "prefill through the host pool does not run with tensor parallelism yet")
            probe.streamed = True
            need = sparse.streamed_pages(probe, self.max_model_len)
            if need > num_pages:
                raise ValueError(f"the prompt is longer than the GPU KV pool; streaming its prefill through the "
                                 f"host pool needs {need} pages but the cache holds only {num_pages}: raise "
                                 f"--kv-cache-gb or lower max_tokens")
        if sparse is not None:  # a request whose full KV can never fit the host pool would wait forever
            if sparse.may_go_sparse(probe, self.max_model_len):
                need = sparse.L * sparse.max_blocks(probe, self.max_model_len) * sparse.Hkv
                if need > sparse.host.num_items:
                    raise ValueError(f"the request's full KV ({need * sparse.item_bytes / 2**30:.2f} GiB for "
                                     f"prompt + max_tokens) exceeds the host KV pool "
                                     f"({sparse.host.num_items * sparse.item_bytes / 2**30:.2f} GiB); "
                                     f"lower max_tokens or raise --host-kv-gb")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.seqs:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = Sequence(rid, token_ids, params, prompt=prompt if isinstance(prompt, str) else None)
        if params.min_tokens:
            vocab = self.runner.model_config.vocab_size
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            seq.min_tokens_stop_ids = sorted(t for t in stops if t < vocab)
        if params.structured is not None:  # a schema that does not compile is the caller's ValueError
            seq.grammar = self.grammars.matcher(params.structured)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq)
            seq.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished()

    def gpu_bytes_by_kind(self) -> dict[str, int]:
        """GPU memory by kind now (`memory_plan`): the start-up plan, the pool's pages by holder."""
        sparse = self.runner.sparse
        return gpu_bytes_by_kind(self.runner.memory_plan, self.scheduler, self.block_manager,
                                 sparse.cfg.working_set_blocks if sparse is not None else 0)

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._in_flight is not None:
            return self._read_in_flight()
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        for seq in batch.seqs:  # the end of its queue time
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
        if self.async_scheduling and not batch.is_prefill and self._overlappable(batch.seqs):
            self._in_flight = InFlight.launch(self.runner, batch)
            return self._read_in_flight()
        t0 = time.perf_counter()
        tokens = self.runner.execute(batch)
        self._account(batch, time.perf_counter() - t0)
        outputs = self.postprocess(batch, tokens)
        self._convert_to_sparse()
        return outputs

    # ---- async scheduling (vLLM's --async-scheduling) --------------------------------------
    def _read_in_flight(self) -> list[RequestOutput]:
        """Launch the next decode step of the same requests first (its inputs are this step's
        samples, still on the device), then read this step's tokens and post-process them while
        the device runs the next one: the host's work leaves the device's critical path."""
        cur, self._in_flight = self._in_flight, None
        nxt = self._next_step_of(cur.batch.seqs)
        if nxt:
            where = {id(s): i for i, s in enumerate(cur.batch.seqs)}
            ids = cur.tokens[on_device([where[id(s)] for s in nxt], cur.tokens.device)]
            for s in nxt:
                s.output_token_ids.append(PENDING)  # this step's token, filled in by postprocess
                if s.sparse is None:  # a sparse request's working set has a fixed size
                    self.block_manager.grow(s, s.num_tokens)
            grammared = any(s.grammar is not None for s in nxt)
            self._in_flight = InFlight.launch(self.runner, ScheduledBatch(nxt, [1] * len(nxt), False), ids,
                                              defer_sampling=grammared)
            self.step_stats["overlapped_steps"] += 1
        tokens = cur.read()
        done = time.perf_counter()
        self._account(cur.batch, done - max(cur.launched, self._last_done))
        self._last_done = done
        outputs = self.postprocess(cur.batch, tokens)
        if self._in_flight is not None and self._in_flight.logits is not None:
            self._in_flight.sample(self.runner)  # the grammars have taken this step's tokens
        return outputs

    def _overlappable(self, seqs: list[Sequence], ahead: int = 0) -> bool:
        """Plain dense decode (with sparse decode on too, while no request of the batch converts
        after the step: `ahead` = 1 for the step after the one in flight), or a batch whose
        requests all decode sparse through the pipeline (their next drafts are chosen on the
        device). A dense batch with grammars overlaps too: its sampling waits for the step before
        (`InFlight.sample`). Mixed batches, conversions, grammars on pipeline rows (sampled inside
        the captured step), logits processors and penalties (which
        look at the tokens so far) and logprobs (read back every step) take the synchronous path."""
        if any(s.params.logits_processors or s.params.has_penalties or s.params.logprobs is not None
               for s in seqs):
            return False
        r = self.runner
        if r.sparse is None:
            return True
        if r.sparse_runner.pending_conversions:  # a request converts after this step
            return False
        if r.is_pipeline_batch(seqs):
            return not any(s.grammar is not None for s in seqs)
        return all(s.sparse is None and not r.sparse.should_convert(s, s.num_tokens + ahead) for s in seqs)

    def _next_step_of(self, seqs: list[Sequence]) -> list[Sequence]:
        """The requests of a step in flight that certainly take another step: none when a prompt
        waits for its admission or its next chunk (the scheduler must run) or pages run short (it
        may preempt); those whose token now reaches max_tokens or the model length leave."""
        if self.scheduler.has_prefill_ready() or not self._overlappable(seqs, ahead=1):
            return []
        nxt = [s for s in seqs if s.status == SequenceStatus.RUNNING and s.error is None
               and len(s.output_token_ids) + 1 < s.params.max_tokens and s.num_tokens + 1 < self.max_model_len]
        need = sum(self.block_manager.pages_needed(s, s.num_tokens + 1) for s in nxt if s.sparse is None)
        return nxt if need <= self.block_manager.num_free else []

    def _convert_to_sparse(self) -> None:
        """Requests whose context passed the threshold this step move their KV to the host."""
        runner = self.runner
        pending = runner.take_conversions()
        if not pending:
            return
        t0, done = time.perf_counter(), runner.sparse.num_conversions
        for seq, last_q in pending:
            if seq.is_finished or seq.sparse is not None or seq.in_prefill:
                continue
            need = runner.sparse.cfg.working_set_blocks
            bm = self.block_manager
            # Free pages first, then pages the request holds alone, for the working set and the
            # summaries' run (conversion reads all its blocks before it writes either).
            free = min(bm.num_free, need)
            own_part = bm.take_own(seq, need - free) if need > free else []
            if own_part is None:
                continue  # no room for the working set now; it stays dense and tries again
            fresh = bm.take(free)
            pages = fresh + own_part
            taken = set(pages)
            own = [p for p in seq.pages if bm.ref_counts[p] == 1 and p not in taken]
            run = bm.take_run(runner.sparse.summary_pages(seq), own)
            if run is None:
                bm.give_back(fresh)
                continue
            runner.convert_to_sparse(seq, last_q, pages, run)
            kept = taken.union(run)
            dense_pages = [p for p in seq.pages if p not in kept]
            seq.pages, seq.convert_early = pages + run, False
            bm.release(reversed(dense_pages))  # shared and named pages stay for other requests
        if runner.sparse.num_conversions > done:
            log.info("%d requests converted to sparse in %.2f s", runner.sparse.num_conversions - done,
                     time.perf_counter() - t0)

    def _account(self, batch, seconds: float) -> None:
        kind = "prefill" if batch.is_prefill else "decode"
        self.step_stats[f"{kind}_steps"] += 1
        self.step_stats[f"{kind}_time"] += seconds
        self.step_stats[f"{kind}_tokens"] += sum(batch.num_tokens)
        if not batch.is_prefill:  # bytes a decode step must read: weights (a MoE's at most) + cached K/V
            r, mc, B = self.runner, self.runner.model_config, len(batch.seqs)
            if B not in self._weight_bytes:  # counted once per batch size, not every step
                self._weight_bytes[B] = weight_bytes_per_step(mc, r.dtype.itemsize, experts_touched_bound(mc, B))
            self.step_stats["decode_bytes"] += self._weight_bytes[B] + kv_bytes_per_step(
                mc, r.dtype.itemsize, sum(s.num_tokens - 1 for s in batch.seqs))

    def postprocess(self, batch, tokens: list[int | None]) -> list[RequestOutput]:
        """Each request's new token: appended, its stop conditions checked, its output made. A
        request whose own work failed (its sampling, here its stop check or its output) ends
        with an error output and frees what it holds; the others go on."""
        now = time.perf_counter()
        outputs = []
        for seq, n, tok in zip(batch.seqs, batch.num_tokens, tokens):
            if seq.is_finished:  # finished (or aborted) while this step was in flight
                continue
            seq.num_cached_tokens += n
            if seq.sparse is None and not seq.streamed:  # its pages are a working set or a staging run
                self.block_manager.name_full_blocks(seq)
            if tok is None:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.error is not None:
                if seq.output_token_ids and seq.output_token_ids[-1] == PENDING:
                    seq.output_token_ids.pop()
                outputs.append(self._fail(seq, now))
                continue
            if seq.output_token_ids and seq.output_token_ids[-1] == PENDING:
                seq.output_token_ids[-1] = tok  # the next step already runs on it
            else:
                seq.output_token_ids.append(tok)
            try:
                if seq.grammar is not None:
                    seq.grammar.accept(tok)
                reason = self._finish_reason(seq, tok)
                if reason:
                    seq.finish_reason, seq.finish_time = reason, now
                    self.scheduler.finish(seq)
                    self.seqs.pop(seq.request_id, None)
                outputs.append(self.make_output(seq))
            except Exception as e:  # noqa: BLE001 - a fault of this request's own work fails only it
                seq.error = f"{type(e).__name__}: {e}"
                outputs.append(self._fail(seq, now))
        return outputs

    def _fail(self, seq: Sequence, now: float) -> RequestOutput:
        """Ends a request whose own work failed: its pages and host extent go back."""
        seq.finish_reason, seq.finish_time = "error", now
        if not seq.is_finished:
            self.scheduler.finish(seq)
        self.seqs.pop(seq.request_id, None)
        try:
            return self.make_output(seq)
        except Exception:  # noqa: BLE001 - its text could not be made either: the ids still can
            return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, "", list(seq.output_token_ids),
                                 "error", True, error=seq.error)

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if seq.grammar is not None and seq.grammar.done:
            return "stop"
        if len(seq.output_token_ids) >= p.min_tokens:  # below min_tokens nothing but a length ends it
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                return "stop"
            if p.stop and self.detokenize and self.tokenizer is not None:
                text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
                tail = len(text) - max(len(s) for s in p.stop) - 8  # only the newest characters can complete one
                hits = [i for i in (text.find(s, max(0, tail)) for s in p.stop) if i >= 0]
                if hits:
                    seq.stop_text_len = min(hits)
                    return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def make_output(self, seq: Sequence) -> RequestOutput:
        text = ""  # made once, at the end: decoding every step's whole output would cost O(n^2)
        if self.detokenize and self.tokenizer is not None and seq.is_finished:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            if seq.stop_text_len is not None:
                text = text[:seq.stop_text_len]
        metrics = {"num_preemptions": seq.num_preemptions}
        if seq.first_scheduled_time is not None:
            metrics["queue_time"] = seq.first_scheduled_time - seq.arrival_time
        if seq.first_token_time is not None:
            metrics["ttft"] = seq.first_token_time - seq.arrival_time
            if seq.first_scheduled_time is not None:
                metrics["prefill_time"] = seq.first_token_time - seq.first_scheduled_time
        if seq.finish_time is not None:
            metrics["e2el"] = seq.finish_time - seq.arrival_time
            n = len(seq.output_token_ids)
            metrics["tpot"] = (seq.finish_time - seq.first_token_time) / (n - 1) if n > 1 else 0.0
            metrics["decode_time"] = seq.finish_time - seq.first_token_time
        stats = {}
        if seq.sparse is not None:
            ws = seq.sparse
            stats = ws.stats.as_dict(ws.cfg.working_set_blocks, -(-seq.num_tokens // self.config.block_size))
        p = seq.params
        asked = p.logprobs is not None
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, text,
                             list(seq.output_token_ids), seq.finish_reason, seq.is_finished, metrics, stats,
                             logprobs=list(seq.logprobs) if asked else None,
                             # complete once the prompt is done, never changed after: shared, not copied
                             prompt_logprobs=(seq.prompt_logprobs or [None]) if p.prompt_logprobs is not None else None,
                             cumulative_logprob=seq.cumulative_logprob if asked else None, error=seq.error,
                             num_cached_tokens=seq.prefix_hit_tokens, num_host_cached_tokens=seq.host_hit_tokens)
