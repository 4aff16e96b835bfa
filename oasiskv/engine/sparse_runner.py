"""The sparse half of the model runner: decode steps of the sparse requests, through the
lookahead pipeline (docs/design.md: device-resident state of every sparse request, the stages on
side streams and one CUDA graph per step on CUDA, in order on CPU). A step runs two query rows
per request, the token and its lookahead draft, and picks the next draft on the device
(`_lookahead_samples`, `LookaheadPipeline.advance_drafts`). `ModelRunner` holds one
`SparseRunner` when sparse decode is on and hands it the batches that need it.
"""
from __future__ import annotations

import logging
import time

import torch

from oasiskv.engine.sampler import draw_noise, on_device, read_host, sample_requests, to_host
from oasiskv.engine.sequence import Sequence
from oasiskv.models.llama import LlamaForCausalLM
from oasiskv.sparse.decode_step import SparseDecodeStep
from oasiskv.sparse.drafters import Drafter
from oasiskv.sparse.manager import SparseManager
from oasiskv.sparse.pipeline import LookaheadPipeline

log = logging.getLogger(__name__)


class SparseRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], manager: SparseManager,
                 pipeline: LookaheadPipeline, graph_buckets: list[int], use_graph: bool,
                 attention_splits: int | None):
        """manager: the requests' sparse state outside the step; pipeline: the step itself;
        graph_buckets: the batch sizes a captured step is built for; use_graph: pipeline steps
        replay CUDA graphs; attention_splits: the decode kernel's splits over a batch of working
        sets alone (`PipelineTuning.attention_splits`)."""
        self.model, self.kv_caches, self.manager, self.pipeline = model, kv_caches, manager, pipeline
        self.model_config = manager.mc  # the rank's shard above tensor-parallel size 1
        self.device, self.dtype = manager.device, manager.dtype
        self.block_size, self.num_kv_heads = manager.block_size, manager.Hkv
        self.graph_buckets, self.use_graph, self.attention_splits = graph_buckets, use_graph, attention_splits
        self.pipeline_steps: dict[tuple[int, int], SparseDecodeStep] = {}  # per (batch bucket, scan width)
        # Requests that convert after this step, with the query their last token recorded in every
        # layer; the engine takes them after the step (`take_conversions`).
        self.pending_conversions: list[tuple[Sequence, torch.Tensor]] = []

    def record_query(self, seq: Sequence) -> torch.Tensor:
        """A buffer [L, Hq, D] the step fills with `seq`'s last query, for its conversion."""
        mc = self.model_config
        buf = torch.empty(mc.num_layers, mc.num_heads, mc.head_dim, dtype=self.dtype, device=self.device)
        self.pending_conversions.append((seq, buf))
        return buf

    def take_conversions(self) -> list[tuple[Sequence, torch.Tensor]]:
        pending, self.pending_conversions = self.pending_conversions, []
        return pending

    def run_pipeline_decode(self, seqs: list[Sequence]) -> list[int]:
        """One step of the sparse requests through the pipeline, waiting for its tokens."""
        pairs, host, ready = self.launch_pipeline_decode(seqs)
        return self.read_pipeline_decode(seqs, read_host(host, ready))

    def pipeline_step(self, bucket: int, scan: int, use_graph: bool) -> SparseDecodeStep:
        """The pipeline's decode step over `bucket` rows whose prediction scans `scan` blocks
        per request, built (a CUDA graph captured) once."""
        step = self.pipeline_steps.get((bucket, scan))
        if step is None:
            t0 = time.perf_counter()
            step = self.pipeline_steps[bucket, scan] = SparseDecodeStep(
                self.model, self.kv_caches, self.pipeline, self.model_config.max_position_embeddings, use_graph,
                rows=bucket, scan_blocks=scan)
            log.debug("sparse decode step for %d rows, %d blocks built in %.2f s", bucket, scan,
                      time.perf_counter() - t0)
        return step

    def scan_width(self, seqs: list[Sequence]) -> int:
        """The narrowest prediction scan that holds every request of the step: the blocks its
        next step will have, and a block to spare (no wider than the model's length: a request
        near `max_model_len` has every block it can have)."""
        need = min(max(s.num_tokens for s in seqs) // self.block_size + 3, self.pipeline.max_blocks)
        return next(b for b in self.pipeline.scan_widths if b >= need)

    def capture_pipeline_steps(self) -> None:
        """Every (batch bucket, scan width) sparse step at start-up, as the dense graphs are: the
        first conversion then does not stop the engine for compilation and capture."""
        t0 = time.perf_counter()
        for bucket in self.graph_buckets:
            for scan in self.pipeline.scan_widths:
                self.pipeline_step(bucket, scan, use_graph=True)
        log.info("captured the sparse decode step for %d batch sizes x scan widths in %.1f s",
                 len(self.pipeline_steps), time.perf_counter() - t0)

    def launch_pipeline_decode(self, seqs: list[Sequence], ids: torch.Tensor | None = None):
        """A step of the sparse requests that does not wait for the device: the pipeline's used
        rows run as one bucket (rows of requests not in this batch, and padding, are inactive:
        they write and fetch nothing). ids: [n, 2] (token, draft) per request on the device, the
        last step's outputs under async scheduling; default: from the host. Returns [n, 2]
        (token, next draft) on the device, their pinned host copy and the copy's event (None
        on CPU), as `launch_decode`; `read_pipeline_decode` takes the host values."""
        p, dev = self.pipeline, self.device
        if p.remote is not None and self.manager.remote is not None:  # a decode instance's rows
            self.manager.remote.before_pipeline_step(p, seqs)
        n = p.num_rows
        bucket = next((b for b in self.graph_buckets if b >= n), n) if self.use_graph else n
        step = self.pipeline_step(bucket, self.scan_width(seqs), self.use_graph)
        if ids is None:
            ids = on_device([[s.last_token_id, s.sparse.draft if s.sparse.draft is not None else s.last_token_id]
                             for s in seqs], dev)
        rows = on_device([s.sparse.row for s in seqs], dev)
        row_ids = torch.zeros(bucket, 2, dtype=torch.long, device=dev)
        row_ids[rows] = ids
        active = torch.zeros(bucket, dtype=torch.bool, device=dev)
        active.index_fill_(0, rows, True)  # (`active[rows] = True` copies the scalar from the host: a sync)
        p.active[:bucket].copy_(active)
        oracle = self.manager.drafter.first_pass
        if oracle:  # a first pass finds the true next tokens; the step sends them as its drafts
            hidden = step.first_pass(row_ids.view(-1))
            truth = sample_requests(self.model.compute_logits(hidden.view(bucket, 2, -1)[rows, 0]), seqs)
            ids = torch.stack([ids[:, 0], truth], 1)
            row_ids[rows] = ids
            for s, tok in zip(seqs, truth.tolist()):  # (read back: evaluation only)
                s.sparse.draft = tok
        hidden = step.run(row_ids.view(-1))
        if oracle:
            tokens = guesses = truth
        else:
            logits = self.model.compute_logits(hidden.view(bucket, 2, -1)[rows].flatten(0, 1))
            tokens, guesses = self._lookahead_samples(seqs, logits[0::2], logits[1::2], ids[:, 1])
        drafts = p.advance_drafts(self.manager.drafter.name, rows, ids[:, 1], tokens, guesses)
        pairs = torch.stack([tokens, drafts], 1)
        if p.remote is not None:  # its wanted blocks, covered by the read of the pairs below
            p.remote.stage_wanted(bucket)
        # The host copy carries the step's clock stamps and counters after the pairs (`read_step`).
        return pairs, *to_host(torch.cat([pairs.flatten(), p.step_readout()]))

    def read_pipeline_decode(self, seqs: list[Sequence], pairs: list[list[int]]) -> list[int]:
        """A pipeline step's (token, next draft) per request, then its clock stamps and counters
        (`launch_pipeline_decode`), read back: the step's stall, bytes and hits go to the totals
        and the stall to each request's stats (every step, overlapped ones too); count the step and
        whether its draft was right, and keep the next draft (the device chose it, from the
        row's history on the device; the host's `ws.history` is not kept up for pipeline rows)."""
        drafter = self.manager.drafter
        n = len(seqs)
        if self.pipeline.remote is not None and self.manager.remote is not None:
            self.manager.remote.after_pipeline_step(self.pipeline)
        step = self.pipeline.read_step(pairs[2 * n:])
        self.manager.count_step(step)
        pairs = list(zip(pairs[0:2 * n:2], pairs[1:2 * n:2]))
        for s in seqs:
            if s.sparse is not None and not s.is_finished:
                s.sparse.stats.stall_s += step["stall_s"]
        for s, (tok, draft) in zip(seqs, pairs):
            ws = s.sparse
            if ws is None or s.is_finished:  # finished, aborted or preempted while in flight
                continue  # (its row ran the step: a request that ends on EOS under async
                #            scheduling counts one extra step's hits and admissions)
            self._count_step(ws, drafter, tok)
            ws.draft = draft
        return [tok for tok, _ in pairs]

    @staticmethod
    def _count_step(ws, drafter: Drafter, tok: int) -> None:
        """A step of the request is done: count it, and whether its draft was `tok`."""
        ws.stats.steps += 1
        if drafter.sends_draft_token:
            ws.stats.drafts += 1
            ws.stats.drafts_accepted += int(ws.draft == tok)

    def _lookahead_samples(self, seqs: list[Sequence], token_logits: torch.Tensor,
                           draft_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A two-row step's tokens (real rows) and guesses (draft rows: the next draft if the
        chain holds), on the device. A sampled sparse request draws each position's noise one
        step early (`ws.noise`, see `sample`): its draft row samples with the noise its real row
        will use at the next step, so while the chain holds the draft is the very token sampling
        will pick, as the argmax is under greedy. Each request's stream of draws keeps its order
        (one position after another), so a seeded request samples as it does in dense decode.
        The draft row gets the request's penalties, bias and min_tokens as they will stand once
        its draft (`drafts`, the draft rows' input tokens) is generated, for the same reason."""
        if all(s.params.greedy for s in seqs):
            return sample_requests(token_logits, seqs), sample_requests(draft_logits, seqs, appended=drafts)
        vocab, dev = token_logits.shape[-1], token_logits.device
        held = [s.sparse.noise if s.sparse is not None else None for s in seqs]
        missing = [i for i, n in enumerate(held) if n is None]
        if missing:  # dense rows, and a request's first sparse step
            for i, row in zip(missing, draw_noise([seqs[i].generator for i in missing], vocab, dev)):
                held[i] = row
        tokens = sample_requests(token_logits, seqs, noise=torch.stack(held))
        # The next position's noise; a dense row's own stream is left alone.
        ahead = draw_noise([s.generator if s.sparse is not None else None for s in seqs], vocab, dev)
        guesses = sample_requests(draft_logits, seqs, noise=ahead, appended=drafts)
        for s, row in zip(seqs, ahead):
            if s.sparse is not None:
                s.sparse.noise = row
        return tokens, guesses
