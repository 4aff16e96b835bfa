"""`oasiskv bench decode`: decode throughput of dense vs sparse at long context (docs/benchmarks.md).

No long prefill is run: the KV of every request is synthetic (random keys and values written
into the GPU page pool, the host pool and the block summaries), then the batch decodes
`--steps` steps the way the engine does (graph replay, logits, greedy sampling, tokens back
to the host every step). Dense attends every cached token from GPU pages; sparse attends its
head-wise working set and runs the lookahead pipeline (predict, select, transfer) beside it.
Both modes follow the engine's `--async-scheduling` (auto: on with CUDA): step t+1 is launched
on step t's samples, still on the device, before the host reads step t's tokens.

Random data makes the prediction churn: the predicted top-K of a step shares little with the
last one, so the fetch cap is saturated every step — the worst case for the transfer path.
The hit rate is reported so the reader can see it.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import time

import torch

from oasiskv.bench.roofline import HBM_BYTES_PER_S, PCIE_BYTES_PER_S
from oasiskv.engine.sampler import read_host, to_host
from oasiskv.entrypoints.args import engine_config
from oasiskv.bench.ceilings import measure as measure_ceilings
from oasiskv.layers.moe import experts_touched
from oasiskv.models.step_bytes import weight_bytes_per_step
from oasiskv.sparse.tuning import STAGE_FORKS, PipelineTuning

FETCH_RATIOS = (0.01, 0.02, 0.05, 0.1, 0.2, 1.0)
TRANSFER_PRIORITIES = {"normal": 0, "high": -1}  # --transfer-priorities: torch stream priorities (lower is higher)


def add_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-len", type=int, default=32768)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--mode", choices=["dense", "sparse", "both"], default="both")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--transfer-programs", default="auto",
                   help="programs (≈ SMs) of the host->GPU gather kernel, optionally :items each has in flight "
                        "(default 4) and :warps (default 8) (auto: the pipeline's, 4:16:32); a comma list runs "
                        "sparse once per value")
    p.add_argument("--transfer-backend", default="uva",
                   help="uva (bounded-grid kernel reading pinned host memory, inside the step) or dma "
                        "(CPU gather into pinned staging + one copy, between steps); a comma list runs each")
    p.add_argument("--deferred-layers", default=None,
                   help="comma list: last layers whose transfer opens the next step (default: the pipeline's)")
    p.add_argument("--attention-splits", default=None,
                   help="comma list: splits per (request, kv head) of the sparse foreground's decode kernel; 0 = "
                        "the kernel's own choice, 1 = one program each and no merge launch (default: the "
                        "pipeline's, 1)")
    p.add_argument("--attention-stages", default=None,
                   help="comma list: software-pipeline stages of the sparse foreground's decode kernel (5 keeps "
                        "two K/V tiles in flight; default: the kernel's)")
    p.add_argument("--stage-forks", default=None,
                   help="comma list of " + " / ".join(STAGE_FORKS) + ": the part of each layer after which the "
                        "pipeline's stages start on their streams (default: the pipeline's, from the context)")
    p.add_argument("--transfer-priorities", default="auto",
                   help="comma list of normal / high: the sparse pipeline's transfer stream at the default "
                        "priority, or at a higher one so the fetch's programs take SMs first (auto: the "
                        "pipeline's, high)")
    p.add_argument("--gemm-sm-carveouts", default=None,
                   help="comma list: sparse runs whose GEMMs (cuBLASLt) leave N SMs to the pipeline "
                        "(0: none; default: the pipeline's, 8)")
    p.add_argument("--blas-library", choices=["default", "cublas", "cublaslt"], default="default",
                   help="torch's preferred BLAS library outside the sparse step (dense runs, logits); the "
                        "sparse step's GEMMs run through cuBLASLt")
    p.add_argument("--summary-dtypes", default=None,
                   help="comma list of auto / fp8: run sparse once per summary dtype, side by side (default: "
                        "the engine's --summary-dtype only); the other sparse runs take the first")
    p.add_argument("--async-modes", default=None,
                   help="comma list of off / on: run the equal-batch part once per async-scheduling mode, side "
                        "by side (default: the engine's --async-scheduling only)")
    p.add_argument("--stage-ablation", action="store_true",
                   help="also run sparse with the first pipeline stage only (predict), then the first two "
                        "(predict, select): what each stage adds to the step (not valid decodes)")
    p.add_argument("--no-prefetch-run", action="store_true",
                   help="also run sparse with the pipeline's stages off: the foreground alone (not a valid "
                        "decode — nothing is fetched — but its time is the floor the pipeline adds to)")
    p.add_argument("--sweep", action="store_true", help="dense and sparse over --batch-sizes x --context-lens")
    p.add_argument("--batch-sizes", default="1,4,16,32")
    p.add_argument("--context-lens", default="16384,32768")
    p.add_argument("--gpu-kv-gb", type=float, default=None,
                   help="capacity mode: GPU memory (GiB) for KV state — dense pages, or sparse working "
                        "sets + summaries; reports the largest batch each mode admits and its throughput")
    p.add_argument("--fetch-ablation", action="store_true", help="sparse across fetch ratios " +
                   ", ".join(map(str, FETCH_RATIOS)) + ", then the auto transfer budget at the default ratio")
    p.add_argument("--fetch-ablation-batches", default=None,
                   help="comma list: the fetch-cap ablation at each batch size, at --context-len (default: "
                        "--batch-size)")
    p.add_argument("--host-pages", choices=["huge", "base"], default="huge",
                   help="the pinned host pool on 2 MiB transparent huge pages (default) or 4 KiB base pages")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG of throughput vs batch (with --sweep)")


class DecodeBench:
    """One model, one GPU page pool and one host pool, reused by every run of one invocation."""

    def __init__(self, args, group=None):
        """group: this rank's ParallelGroup when every rank runs the benchmark (size > 1): the
        runner, the pools and every figure are then the rank's own shard's."""
        from oasiskv.engine.model_runner import ModelRunner

        self.args = args
        batches = (_ints(args.batch_sizes) if args.sweep else [args.batch_size]) + ablation_batches(args)
        contexts = _ints(args.context_lens) if args.sweep else [args.context_len]
        self.tail = args.warmup + args.steps + 2 * 16 + 1  # room for decoded tokens and capture warm-ups
        cfg = engine_config(args)
        cfg = dataclasses.replace(cfg.with_sparse(enabled=False), max_model_len=max(contexts) + self.tail,
                                  max_num_seqs=max(max(batches), args.batch_size))
        # this card's copy and GEMM rates, measured before the model takes its memory
        self.ceilings = measure_ceilings() if torch.cuda.is_available() and group is None else None
        self._touched: dict[int, int | None] = {}
        t0 = time.perf_counter()
        if group is None:
            self.runner = r = ModelRunner(cfg)
        else:
            from oasiskv.distributed.worker import ParallelModelRunner
            self.runner = r = ParallelModelRunner(cfg, group)
        self.group = group
        self.load_s = time.perf_counter() - t0
        self.mc, self.bs = r.model_config, r.block_size  # the rank's heads at size > 1
        # Every byte figure is one GPU's: above size 1 its shard's weights (its vocabulary rows),
        # its heads' KV and summaries, its own fetches; the roofline is then one GPU's bandwidth.
        self.weight_config = self.mc if group is None else dataclasses.replace(self.mc, vocab_size=r.plan.vocab_shard)
        r.kv.normal_()  # synthetic KV everywhere in the GPU pool
        self.host = None
        self.host_setup_s = self.host_huge_gb = None
        self.sparse_cfg = dataclasses.replace(cfg.sparse, enabled=True)  # validates the flags
        if args.summary_dtypes:  # runs not swept over it (ablation, capacity, no-prefetch) take the first
            self.sparse_cfg = dataclasses.replace(self.sparse_cfg, summary_dtype=args.summary_dtypes.split(",")[0])
        self.overlap = cfg.async_scheduling == "on" or (cfg.async_scheduling == "auto" and r.device.type == "cuda")
        self.tuning = sweep_tunings(args)[0]  # the first value of each tuning flag

    # ---- sizes ----------------------------------------------------------------------
    def blocks(self, context: int) -> int:
        return math.ceil((context + self.tail) / self.bs)

    @property
    def page_bytes(self) -> int:
        return self.runner.kv_bytes_per_page

    def summary_bytes(self, context: int, summary_dtype: str | None = None) -> int:
        from oasiskv.sparse import summaries

        mc = self.mc
        size = summaries.summary_dtype(summary_dtype or self.sparse_cfg.summary_dtype, self.runner.dtype,
                                      self.runner.device).itemsize
        return 2 * self.blocks(context) * mc.num_layers * mc.num_kv_heads * mc.head_dim * size

    def host_bytes(self, context: int) -> int:
        return self.blocks(context) * self.page_bytes

    # ---- dense ----------------------------------------------------------------------
    @torch.inference_mode()
    def run_dense(self, batch: int, context: int) -> dict:
        from oasiskv.engine.sequence import Sequence
        from oasiskv.sampling_params import SamplingParams

        r, nb = self.runner, self.blocks(context)
        if batch * nb > r.num_pages:
            return self._no_fit("dense", batch, context, f"needs {batch * nb} GPU pages, the pool has {r.num_pages}")
        gen = torch.Generator().manual_seed(0)
        vocab = self.mc.vocab_size
        seqs = []
        for i in range(batch):
            s = Sequence(f"d{i}", torch.randint(0, vocab, (context,), generator=gen).tolist(),
                         SamplingParams(temperature=0, max_tokens=self.tail, ignore_eos=True))
            s.pages = list(range(i * nb, (i + 1) * nb))
            s.num_cached_tokens = context - 1
            seqs.append(s)

        if self.overlap:
            from oasiskv.engine.sequence import PENDING
            in_flight = None

            def step():  # as LLMEngine._read_in_flight: launch t+1, then read t
                nonlocal in_flight
                launched = r.launch_decode(seqs, in_flight[0] if in_flight else None)
                for s in seqs:
                    s.output_token_ids.append(PENDING)  # this step's token, read a step later
                if in_flight is not None:
                    for s, t in zip(seqs, read_host(*in_flight[1:])):
                        s.output_token_ids[-2] = t
                in_flight = launched
        else:
            def step():
                tokens = r.model.compute_logits(r.run_decode(seqs)).argmax(-1).tolist()
                for s, t in zip(seqs, tokens):
                    s.output_token_ids.append(t)

        seconds = self._time(step)
        kv = batch * context * self.mc.kv_bytes_per_token(r.dtype.itemsize)
        return self._result("dense", batch, context, seconds, kv_read=kv, summaries=0, fetched=0)

    # ---- sparse ---------------------------------------------------------------------
    @torch.inference_mode()
    def run_sparse(self, batch: int, context: int, tuning: PipelineTuning | None = None,
                   fetch_ratio: float | None = None, transfer_backend: str | None = None,
                   summary_dtype: str | None = None, fetch_budget: str = "off") -> dict:
        """tuning: the pipeline's (default: the first value of each tuning flag); transfer_backend:
        uva (the pipeline's fetch) or dma (`DmaTransfer` between steps; default: the flag's first)."""
        from oasiskv.bench.dma_transfer import DmaTransfer
        from oasiskv.sparse.decode_step import SparseDecodeStep
        from oasiskv.sparse.pipeline import LookaheadPipeline, PipelineTiming
        from oasiskv.sparse.summaries import summary_dtype as summary_dtype_of
        from oasiskv.sparse.summary_arena import blocks_per_page, pages_for

        r, mc, bs = self.runner, self.mc, self.bs
        tuning = tuning or self.tuning
        transfer_backend = transfer_backend or self.args.transfer_backend.split(",")[0]
        # The fixed cap alone unless asked (`fetch_budget`): "auto" reads each step's clock back
        # with its tokens, as the engine does, so the budget follows the measured foreground.
        cfg = dataclasses.replace(self.sparse_cfg, fetch_ratio=fetch_ratio or self.sparse_cfg.fetch_ratio,
                                  summary_dtype=summary_dtype or self.sparse_cfg.summary_dtype,
                                  fetch_budget=fetch_budget)
        P, K, S, W = cfg.working_set_blocks, cfg.top_k_blocks, cfg.sink_blocks, cfg.window_blocks
        nb = self.blocks(context)
        summary_pages = pages_for(batch * nb, blocks_per_page(bs, r.dtype, summary_dtype_of(
            cfg.summary_dtype, r.dtype, r.device)))
        if batch * P + summary_pages > r.num_pages:
            return self._no_fit("sparse", batch, context, f"needs {batch * P} GPU pages for working sets and "
                                f"{summary_pages} for summaries, the pool has {r.num_pages}")
        host = self._host_pool()
        extents = [host.allocate(f"s{i}", mc.num_layers, nb, mc.num_kv_heads) for i in range(batch)]
        try:
            if any(e is None for e in extents):
                return self._no_fit("sparse", batch, context,
                                    f"host pool holds {host.num_items * host.item_bytes / 2**30:.0f} GiB")
            dma = transfer_backend == "dma" and tuning.stages == 3
            # dma: the pipeline predicts and selects; the host moves the admissions after the step
            p = LookaheadPipeline(cfg, mc, r.kv, host, max_rows=batch, max_blocks=nb, block_size=bs,
                                  tuning=dataclasses.replace(tuning, stages=2) if dma else tuning)
            transfer_on_host = DmaTransfer(p) if dma else None
            first = p.arena.offset(batch * P)  # the summaries in the pages after the working sets'
            for i, e in enumerate(extents):
                p.bind(i, list(range(i * P, (i + 1) * P)), e, summary_offset=first + i * nb)
            # Synthetic state: K distinct dynamic blocks per (layer, head) from between the sinks
            # and the window, random summaries (min <= max) for every block.
            choices = (context - 1) // bs - W + 1 - S
            pick = torch.rand(mc.num_layers, batch * mc.num_kv_heads, choices, device=r.device).argsort(-1)
            p.resident.copy_((pick[..., :K] + S).int())
            p.last.zero_()
            held = slice(first, first + batch * nb)
            for layer in range(mc.num_layers):  # a layer at a time: float32 noise for all would need 4x their bytes
                lo = torch.randn(p.kmin[layer, held].shape, device=r.device)
                p.kmin[layer, held] = lo.to(p.kmin.dtype)
                p.kmax[layer, held] = (lo + torch.randn_like(lo).abs()).to(p.kmax.dtype)
            del lo
            p.cached.fill_(context - 1)
            p.active.fill_(True)
            use_graph = r.device.type == "cuda" and not r.cfg.enforce_eager  # eager above size 1
            p.timing = PipelineTiming(mc.num_layers) if r.device.type == "cuda" else None  # eager too (size > 1)
            step_fn = SparseDecodeStep(r.model, r.kv_caches, p, mc.max_position_embeddings, use_graph)
            # Seeded on the host: every rank feeds the same tokens (the vocabulary is split over them).
            gen = torch.Generator().manual_seed(1)
            ids = torch.randint(0, mc.vocab_size, (batch * 2,), generator=gen).to(r.device)

            in_flight = None
            budgeted = p.budget.enabled

            def step():
                nonlocal ids, in_flight
                hidden = step_fn.run(ids)
                if transfer_on_host is not None:  # dma: the admissions move before anything else runs
                    transfer_on_host()
                logits = r.model.compute_logits(hidden)
                tokens = logits[0::2].argmax(-1)
                drafts = logits[1::2].argmax(-1)  # `self`: the draft row's own next-token guess
                ids = torch.stack([tokens, drafts], 1).view(-1)
                # The engine needs the tokens on the host every step: now, or (async) one step later;
                # under a budget the step's clock and counters come with them.
                launched = to_host(torch.cat([tokens, p.step_readout().long()]) if budgeted else tokens)
                if not self.overlap:
                    done = read_host(*launched)
                elif in_flight is not None:
                    done = read_host(*in_flight)
                else:
                    done = None
                if budgeted and done is not None:
                    p.read_step(done[batch:])
                in_flight = launched

            counters = lambda: (p.stats.sum(0).tolist(), p.fetched_bytes)  # noqa: E731
            seconds, (before, after) = self._time(step, counters)
            (h0, m0, a0, e0), f0 = before
            (h1, m1, a1, e1), f1 = after
            fetched = (f1 - f0) / self.args.steps
            ws_tokens = (S + K + W - 1) * bs + bs // 2  # sinks, dynamic, full window blocks, half a block
            kv = batch * ws_tokens * mc.kv_bytes_per_token(r.dtype.itemsize)
            summaries = batch * self.summary_bytes(context, cfg.summary_dtype) * ((context // bs) / nb)  # scored range
            res = self._result("sparse", batch, context, seconds, kv_read=kv, summaries=summaries,
                               fetched=fetched)
            res.update(fetch_ratio=cfg.fetch_ratio, cap=cfg.fetch_cap, top_k_blocks=K, prefetch=tuning.stages > 0,
                       fetch_budget=fetch_budget,
                       budget_mb_per_step=p.budget.step_bytes / 1e6 if p.budget.enabled else None,
                       pipeline_stages=tuning.stages,
                       transfer_programs=tuning.transfer_programs, transfer_items=tuning.transfer_items,
                       transfer_warps=tuning.transfer_warps, transfer_backend=transfer_backend,
                       bounds_tiling=":".join(map(str, p.bounds_tiling)), summary_dtype=cfg.summary_dtype,
                       deferred_layers=len(p.deferred_range()), attention_splits=tuning.attention_splits or 0,
                       gemm_sm_carveout=tuning.gemm_sm_carveout, attention_stages=p.attention_stages or 0,
                       stages_fork=p.stages_fork,
                       transfer_priority=next((name for name, value in TRANSFER_PRIORITIES.items()
                                               if value == tuning.transfer_priority), str(tuning.transfer_priority)),
                       hit_rate=(h1 - h0) / max(1, h1 - h0 + m1 - m0),
                       admitted_per_step=(a1 - a0) / self.args.steps)
            if p.timing is not None and p.prefetch:
                res.update(self._stall(step, p.timing, res["step_ms"]))
            del step_fn, p
            return res
        except torch.cuda.OutOfMemoryError:  # the summaries and the pipeline's buffers sit beside the KV pool
            return self._no_fit("sparse", batch, context,
                                "the summaries and pipeline buffers do not fit in the GPU memory beside the KV pool")
        finally:
            for i, e in enumerate(extents):
                if e is not None:
                    host.free(f"s{i}")
            torch.cuda.empty_cache() if r.device.type == "cuda" else None

    def _host_pool(self):
        from oasiskv.sparse.host_pool import HostKVPool, anon_huge_page_bytes

        if self.host is None:
            mc, r = self.mc, self.runner
            t0 = time.perf_counter()
            self.host = HostKVPool(r.cfg.sparse.host_kv_gb, self.bs, mc.head_dim, r.dtype, pin=r.device.type == "cuda",
                                   huge_pages=self.args.host_pages == "huge")
            flat = self.host.items.view(-1)
            chunk = torch.randn(min(flat.numel(), 2**28), dtype=r.dtype, device=r.device)
            for start in range(0, flat.numel(), chunk.numel()):  # synthetic host KV, through PCIe
                n = min(chunk.numel(), flat.numel() - start)
                flat[start:start + n].copy_(chunk[:n])
            self.host_setup_s = time.perf_counter() - t0
            self.host_huge_gb = anon_huge_page_bytes() / 2**30
            print(f"host pool: {self.host.items.numel() * self.host.items.element_size() / 2**30:.1f} GiB, "
                  f"{self.args.host_pages} pages asked, {self.host_huge_gb:.1f} GiB of the process on huge pages, "
                  f"set up in {self.host_setup_s:.1f} s", flush=True)
        return self.host

    # ---- timing and the result row ----------------------------------------------------
    def _time(self, step, counters=None):
        sync = torch.cuda.synchronize if self.runner.device.type == "cuda" else (lambda: None)
        for _ in range(self.args.warmup):
            step()
        sync()
        before = counters() if counters else None
        t0 = time.perf_counter()
        for _ in range(self.args.steps):
            step()
        sync()
        seconds = (time.perf_counter() - t0) / self.args.steps
        if counters:
            return seconds, (before, counters())
        return seconds

    def _stall(self, step, timing, step_ms: float, samples: int = 16) -> dict:
        """Separate pass (reading events costs host time): per step, how long the foreground
        waited at the join, and how many layers' transfers ended after the foreground did."""
        stalls, late, fg = [], [], []
        for _ in range(samples):
            step()
            torch.cuda.synchronize()
            t = timing.read()
            stalls.append(t["stall_ms"])
            late.append(t["late_layers"])
            fg.append(t["foreground_ms"])
        n = self.mc.num_layers
        stall = sum(stalls) / samples
        return {"stall_ms": stall, "stall_fraction": stall / step_ms,
                "late_layer_share": sum(late) / (samples * n), "foreground_ms": sum(fg) / samples}

    @torch.inference_mode()
    def experts_touched(self, batch: int) -> int | None:
        """A MoE model's distinct experts a decode step of `batch` random tokens routes to, summed
        over the layers (one eager step of one-token sequences); None for a dense model."""
        from oasiskv.engine.sequence import Sequence
        from oasiskv.sampling_params import SamplingParams

        r = self.runner
        if not self.mc.num_experts or batch > r.num_pages:
            return None
        if batch not in self._touched:
            gen = torch.Generator().manual_seed(batch)
            ids = torch.randint(0, self.mc.vocab_size, (batch,), generator=gen)
            seqs = [Sequence(f"m{i}", [int(t)], SamplingParams(max_tokens=1)) for i, t in enumerate(ids)]
            for i, s in enumerate(seqs):
                s.pages = [i]
            ids, positions, meta = r.prepare_decode(seqs, ids.to(r.device))
            self._touched[batch] = experts_touched(r.model, lambda: r.model(ids, positions, r.kv_caches, meta))
        return self._touched[batch]

    def _result(self, mode, batch, context, seconds, kv_read, summaries, fetched) -> dict:
        experts = self.experts_touched(batch)
        weights = weight_bytes_per_step(self.weight_config, self.runner.dtype.itemsize, experts)
        hbm_bytes = weights + kv_read + summaries + fetched  # fetched items land in HBM
        hbm_s = hbm_bytes / HBM_BYTES_PER_S
        pcie_s = fetched / PCIE_BYTES_PER_S
        measured = {}
        if self.ceilings:
            measured["measured_copy_fraction"] = hbm_bytes / seconds / self.ceilings["copy_bytes_per_s"]
        if experts is not None:
            moe_layers = sum(self.mc.is_moe_layer(layer) for layer in range(self.mc.num_layers))
            measured["experts_touched_per_layer"] = experts / moe_layers
        return measured | {
            "mode": mode, "batch": batch, "context": context, "fits": True, "async_scheduling": self.overlap,
            "step_ms": 1e3 * seconds, "tpot_ms": 1e3 * seconds, "output_tok_s": batch / seconds,
            "weight_bytes": weights, "kv_read_bytes_per_step": kv_read, "summary_bytes_per_step": summaries,
            "fetched_bytes_per_step": fetched, "transfer_gb_s": fetched / seconds / 1e9,
            "roofline_ms": 1e3 * max(hbm_s, pcie_s), "roofline_fraction": max(hbm_s, pcie_s) / seconds,
            "hbm_fraction": hbm_s / seconds, "pcie_fraction": pcie_s / seconds,
        }

    @staticmethod
    def _no_fit(mode, batch, context, why) -> dict:
        return {"mode": mode, "batch": batch, "context": context, "fits": False, "why": why}

    # ---- capacity mode ----------------------------------------------------------------
    def capacity(self, context: int, gpu_kv_gb: float) -> dict:
        """Largest batch each mode admits with `gpu_kv_gb` of GPU memory for KV state (as on a
        card whose weights take the rest), and the throughput at that batch."""
        budget = gpu_kv_gb * 2**30
        dense_max = int(budget // (self.blocks(context) * self.page_bytes))
        per_sparse = self.sparse_cfg.working_set_blocks * self.page_bytes + self.summary_bytes(context)
        sparse_gpu_max = int(budget // per_sparse)
        host_gb = self.runner.cfg.sparse.host_kv_gb  # the rank's share above size 1
        host_max = int(host_gb * 2**30 // self.host_bytes(context))
        sparse_max = min(sparse_gpu_max, host_max)
        out = {"context": context, "gpu_kv_gb": gpu_kv_gb, "dense_max_batch": dense_max,
               "sparse_max_batch_gpu": sparse_gpu_max, "sparse_max_batch_host": host_max,
               "host_kv_gb": host_gb, "sparse_max_batch": sparse_max,
               "bound": "host RAM" if host_max < sparse_gpu_max else "GPU memory"}
        out["dense"] = self.run_dense(dense_max, context) if dense_max else self._no_fit("dense", 0, context, "0")
        out["sparse"] = self.run_sparse(sparse_max, context) if sparse_max else self._no_fit("sparse", 0, context, "0")
        if out["dense"].get("fits") and out["sparse"].get("fits"):
            out["admitted_ratio"] = sparse_max / dense_max
            out["throughput_ratio"] = out["sparse"]["output_tok_s"] / out["dense"]["output_tok_s"]
        return out


def transfer_spec(text: str) -> tuple[int | None, int | None, int | None]:
    """--transfer-programs value P[:ITEMS[:WARPS]] -> (programs, items or None, warps or None);
    "auto" -> all None (the pipeline's)."""
    if text == "auto":
        return None, None, None
    try:
        parts = [int(x) for x in text.split(":")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or min(parts) < 1 or (len(parts) == 3 and parts[2] & (parts[2] - 1)):
        raise ValueError(f"--transfer-programs takes P[:ITEMS[:WARPS]] (positive, WARPS a power of two), not {text!r}")
    return parts[0], (parts[1:2] or [None])[0], (parts[2:3] or [None])[0]


def sweep_tunings(args, programs: str | None = None) -> list[PipelineTuning]:
    """The pipeline tunings the tuning flags ask for, every combination of their comma lists
    (programs: one --transfer-programs value; default: the first)."""
    base = PipelineTuning()
    count, items, warps = transfer_spec(programs or args.transfer_programs.split(",")[0])
    if count:  # P[:ITEMS[:WARPS]]: the kernel's own items and warps where not given
        from oasiskv.kernels.copy_items import ITEMS_PER_LOAD, NUM_WARPS
        base = dataclasses.replace(base, transfer_programs=count, transfer_items=items or ITEMS_PER_LOAD,
                                   transfer_warps=warps or NUM_WARPS)
    listed = lambda text, parse=_ints: parse(text) if text else [None]  # noqa: E731
    tunings = []
    for deferred, splits, carveout, stages, fork, priority in itertools.product(
            listed(args.deferred_layers), listed(args.attention_splits), listed(args.gemm_sm_carveouts),
            listed(args.attention_stages), listed(args.stage_forks, lambda t: t.split(",")),
            args.transfer_priorities.split(",")):
        changes = dict(deferred_layers=deferred, attention_stages=stages, stages_fork=fork)
        if splits is not None:
            changes["attention_splits"] = splits or None  # 0: the kernel's choice
        if carveout is not None:
            changes["gemm_sm_carveout"] = carveout
        if priority != "auto":
            changes["transfer_priority"] = TRANSFER_PRIORITIES[priority]
        tunings.append(dataclasses.replace(base, **changes))
    return tunings


def run_decode_bench(args) -> int:
    for text in args.transfer_programs.split(","):  # bad values fail now, not after the model loads
        transfer_spec(text)
    if args.deferred_layers and any(n < 0 for n in _ints(args.deferred_layers)):
        raise ValueError(f"--deferred-layers takes counts >= 0, not {args.deferred_layers!r}")
    if args.attention_splits and any(n < 0 for n in _ints(args.attention_splits)):
        raise ValueError(f"--attention-splits takes counts >= 0 (0: the kernel's choice), not {args.attention_splits!r}")
    if args.attention_stages and any(n < 1 for n in _ints(args.attention_stages)):
        raise ValueError(f"--attention-stages takes counts >= 1, not {args.attention_stages!r}")
    if args.stage_forks and set(args.stage_forks.split(",")) - set(STAGE_FORKS):
        raise ValueError(f"--stage-forks takes {' / '.join(STAGE_FORKS)}, not {args.stage_forks!r}")
    if set(args.transfer_priorities.split(",")) - set(TRANSFER_PRIORITIES) - {"auto"}:
        raise ValueError(f"--transfer-priorities takes auto / {' / '.join(TRANSFER_PRIORITIES)}, "
                         f"not {args.transfer_priorities!r}")
    if args.gemm_sm_carveouts and any(n < 0 for n in _ints(args.gemm_sm_carveouts)):
        raise ValueError(f"--gemm-sm-carveouts takes counts >= 0, not {args.gemm_sm_carveouts!r}")
    cfg = engine_config(args)
    if cfg.tensor_parallel_size > 1:
        from oasiskv.distributed.every_rank import run_on_every_rank
        return run_on_every_rank(cfg, decode_bench_on_rank, args)
    return decode_bench_on_rank(None, args)


def decode_bench_on_rank(group, args) -> int:
    """The benchmark on one rank (group None: size 1); rank 0 prints and saves the results."""
    if args.blas_library != "default":
        torch.backends.cuda.preferred_blas_library(args.blas_library)
    bench = DecodeBench(args, group)
    rank_0 = group is None or group.rank == 0
    result = {"model": bench.mc.name, "dtype": str(bench.runner.dtype).removeprefix("torch."),
              "device": torch.cuda.get_device_name() if bench.runner.device.type == "cuda" else "cpu",
              "top_k_blocks": bench.sparse_cfg.top_k_blocks, "sink_blocks": bench.sparse_cfg.sink_blocks,
              "window_blocks": bench.sparse_cfg.window_blocks, "fetch_ratio": bench.sparse_cfg.fetch_ratio,
              "transfer_programs": args.transfer_programs.split(","), "steps": args.steps,
              "tensor_parallel_size": 1 if group is None else group.size, "ceilings": bench.ceilings, "runs": []}
    modes = ["dense", "sparse"] if args.mode == "both" else [args.mode]
    def record(run: dict) -> None:  # print and save as each run ends: a crash keeps what ran
        if not result["runs"]:
            print_header()
        result["runs"].append(run)
        print_row(run)
        save()

    def save() -> None:
        result.update(host_pages=args.host_pages, host_setup_s=bench.host_setup_s, host_huge_gb=bench.host_huge_gb)
        if args.output_json and rank_0:
            with open(args.output_json, "w") as f:
                json.dump(result, f, indent=2)

    # One process does every part asked for: the model, pools and graphs are built once.
    if args.sweep or not (args.gpu_kv_gb is not None or args.fetch_ablation):
        batches = _ints(args.batch_sizes) if args.sweep else [args.batch_size]
        contexts = _ints(args.context_lens) if args.sweep else [args.context_len]
        engine_overlap = bench.overlap
        overlaps = [m == "on" for m in args.async_modes.split(",")] if args.async_modes else [engine_overlap]
        for context in contexts:
            for batch in batches:
                for bench.overlap in overlaps:
                    if "dense" in modes:
                        record(bench.run_dense(batch, context))
                    if "sparse" in modes:
                        for backend in args.transfer_backend.split(","):
                            for programs in args.transfer_programs.split(",") if backend == "uva" else ["8"]:
                                for summary, tuning in itertools.product(
                                        (args.summary_dtypes or args.summary_dtype).split(","),
                                        sweep_tunings(args, programs)):
                                    record(bench.run_sparse(batch, context, tuning, transfer_backend=backend,
                                                            summary_dtype=summary))
                        if args.no_prefetch_run:
                            record(bench.run_sparse(batch, context, dataclasses.replace(bench.tuning, stages=0)))
                        if args.stage_ablation:
                            for stages in (1, 2):
                                record(bench.run_sparse(batch, context, dataclasses.replace(bench.tuning,
                                                                                            stages=stages)))
        bench.overlap = engine_overlap
    if args.fetch_ablation:
        result["fetch_ablation"] = []
        for batch in ablation_batches(args):
            print(f"fetch-cap ablation, batch {batch}, context {args.context_len}:")
            print_header()
            runs = []
            for ratio, budget in [(r, "off") for r in FETCH_RATIOS] + [(None, "auto")]:
                runs.append(bench.run_sparse(batch, args.context_len, fetch_ratio=ratio, fetch_budget=budget))
                result["fetch_ablation"].append(runs[-1])
                print_row(runs[-1])
                save()
            print(auto_against_fixed(runs))
    if args.gpu_kv_gb is not None:
        result["capacity"] = cap = bench.capacity(args.context_len, args.gpu_kv_gb)
        print_capacity(cap)
        save()
    if result["runs"]:
        result["speedups"] = speedups(result["runs"])
        for s in result["speedups"]:
            print(f"sparse / dense at batch {s['batch']}, context {s['context']}, async scheduling "
                  f"{'on' if s['async_scheduling'] else 'off'}: {s['speedup']:.2f}x output tok/s")
    save()
    if args.plot and result["runs"] and rank_0:
        plot_sweep(result["runs"], args.plot)
    return 0


def ablation_batches(args) -> list[int]:
    """The batch sizes the fetch-cap ablation runs at (none without --fetch-ablation)."""
    if not args.fetch_ablation:
        return []
    return _ints(args.fetch_ablation_batches) if args.fetch_ablation_batches else [args.batch_size]


def auto_against_fixed(runs: list[dict]) -> str:
    """One line: the auto budget's throughput against the fastest fixed ratio of one ablation."""
    *fixed, auto = runs
    fits = [r for r in fixed if r.get("fits")]
    if not fits or not auto.get("fits"):
        return "auto against the fixed ratios: not every run fits"
    best = max(fits, key=lambda r: r["output_tok_s"])
    return (f"auto budget {auto['output_tok_s']:,.0f} tok/s against the fastest fixed ratio "
            f"({best['fetch_ratio']}) {best['output_tok_s']:,.0f}: {auto['output_tok_s'] / best['output_tok_s']:.3f}x")


def speedups(runs: list[dict]) -> list[dict]:
    by = {}
    for r in runs:  # the best sparse run of each shape (over transfer grids), prefetch on
        key = (r["mode"], r["batch"], r["context"], r.get("async_scheduling"))
        valid = r.get("fits") and r.get("prefetch", True) and r.get("pipeline_stages", 3) == 3
        if valid and (key not in by or r["output_tok_s"] > by[key]["output_tok_s"]):
            by[key] = r
    return [{"batch": b, "context": c, "async_scheduling": a,
             "speedup": by[("sparse", b, c, a)]["output_tok_s"] / d["output_tok_s"]}
            for (m, b, c, a), d in by.items() if m == "dense" and ("sparse", b, c, a) in by]


def print_header() -> None:
    print(f"{'mode':>6} {'batch':>5} {'context':>7} {'async':>5} {'ratio':>5} {'G':>3} {'tok/s':>8} {'step ms':>8} {'KV GB':>6} "
          f"{'fetch MB':>8} {'GB/s':>5} {'hit':>5} {'stall%':>6} {'late%':>5} {'roof%':>5}", flush=True)


def print_row(r: dict) -> None:
    if not r.get("fits"):
        print(f"{r['mode']:>6} {r['batch']:>5} {r['context']:>7}  does not fit: {r['why']}", flush=True)
        return
    sp = r["mode"] == "sparse"
    mode = r["mode"]
    if r.get("pipeline_stages", 3) < 3:
        mode = ("fg", "predict", "select")[r["pipeline_stages"]]
    print(f"{mode:>6} {r['batch']:>5} {r['context']:>7} {'on' if r.get('async_scheduling') else 'off':>5} "
          f"{('auto' if r.get('fetch_budget') == 'auto' else r.get('fetch_ratio', 0)) if sp else '':>5} "
          f"{(r.get('transfer_programs') if r.get('transfer_backend') == 'uva' else 'dma') if sp else '':>3} "
          f"{r['output_tok_s']:>8.0f} {r['step_ms']:>8.2f} {r['kv_read_bytes_per_step'] / 1e9:>6.2f} "
          f"{r['fetched_bytes_per_step'] / 1e6:>8.1f} {r['transfer_gb_s']:>5.1f} "
          f"{100 * r['hit_rate'] if sp else 0:>5.1f} {100 * r.get('stall_fraction', 0):>6.1f} "
          f"{100 * r.get('late_layer_share', 0):>5.1f} {100 * r['roofline_fraction']:>5.1f} "
          f"{'bounds ' + r.get('bounds_tiling', '') if sp else ''} "
          f"{'summaries ' + r.get('summary_dtype', 'auto') if sp else ''} "
          f"{'items ' + str(r.get('transfer_items')) + ' warps ' + str(r.get('transfer_warps')) if sp else ''} "
          f"{'deferred ' + str(r.get('deferred_layers')) if sp else ''} "
          f"{'splits ' + str(r.get('attention_splits') or 'auto') if sp else ''}"
          f"{' carveout ' + str(r['gemm_sm_carveout']) if sp else ''}"
          f"{' stages ' + str(r['attention_stages']) if sp and r.get('attention_stages') else ''}"
          f"{' fork ' + r['stages_fork'] if sp and r.get('stages_fork', 'attention') != 'attention' else ''}"
          f"{' transfer-priority high' if sp and r.get('transfer_priority') == 'high' else ''}"
          f"{' experts %.0f a layer' % r['experts_touched_per_layer'] if 'experts_touched_per_layer' in r else ''}"
          f"{', %.1f%% of the measured copy rate' % (100 * r['measured_copy_fraction']) if 'measured_copy_fraction' in r else ''}",
          flush=True)


def print_capacity(c: dict) -> None:
    print(f"capacity at {c['context']} tokens with {c['gpu_kv_gb']} GiB of GPU KV memory: dense admits "
          f"{c['dense_max_batch']}, sparse {c['sparse_max_batch']} (GPU bound {c['sparse_max_batch_gpu']}, "
          f"host bound {c['sparse_max_batch_host']} with {c['host_kv_gb']} GiB of host pool; bound: {c['bound']})")
    print_header()
    print_row(c["dense"])
    print_row(c["sparse"])
    if "throughput_ratio" in c:
        print(f"sparse admits {c['admitted_ratio']:.1f}x the requests and delivers {c['throughput_ratio']:.2f}x "
              "the output tok/s of dense")


def plot_sweep(runs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("dense", "sparse"):
        for context in sorted({r["context"] for r in runs}):
            best = {}
            for r in runs:
                if r["mode"] == mode and r["context"] == context and r.get("fits") and r.get("prefetch", True) \
                        and r.get("pipeline_stages", 3) == 3:
                    best[r["batch"]] = max(best.get(r["batch"], 0), r["output_tok_s"])
            pts = sorted(best.items())
            if pts:
                ax.plot(*zip(*pts), marker="o", linestyle="-" if mode == "sparse" else "--",
                        label=f"{mode}, {context // 1024}K")
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens / s")
    ax.set_xscale("log", base=2)
    ax.set_title("decode throughput, one H200")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]
