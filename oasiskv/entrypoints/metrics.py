"""Prometheus metrics of the server (`GET /metrics`), named after vLLM's with an `oasiskv:` prefix
and a `model_name` label.

Gauges are refreshed by the engine thread after every step; counters and histograms are fed
as outputs leave the engine. Each server owns its registry, so several can live in one process.
"""
from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)


class ServerMetrics:
    """Every metric carries a `model_name` label (the served name), as vLLM's do. Add a metric
    with `self._add(kind, name, help)`: it comes back bound to this server's model name."""
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "SmolLM2-135M-Instruct"):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        add = self._add
        self.engine_alive = add(Gauge, "engine_alive", "1 while the engine runs; 0 once it stopped (a fault, or "
                                "the shutdown).")
        self.running = add(Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = add(Gauge, "num_requests_waiting", "Requests waiting for pages or host-pool room.")
        self.gpu_pages_total = add(Gauge, "gpu_pages_total", "KV pages in the GPU pool.")
        self.gpu_pages_used = add(Gauge, "gpu_pages_used", "KV pages held by requests (dense page tables "
                                  "and sparse working sets).")
        self.kv_usage = add(Gauge, "kv_cache_usage_perc", "Fraction of GPU KV pages in use (1 = full).")
        self.gpu_usage = add(Gauge, "gpu_cache_usage_perc", "The same as kv_cache_usage_perc (vLLM's older name).")
        self.gpu_bytes = Gauge("oasiskv:gpu_memory_bytes", "GPU bytes by kind: weights, kv_dense / "
                               "kv_working_sets / kv_summaries / kv_free (the page pool's pages by holder), "
                               "sparse_pipeline_rows, cuda_graphs.", ["model_name", "kind"], registry=self.registry)
        self.host_bytes_total = add(Gauge, "host_pool_bytes_total", "Size of the host KV pool (0 without --sparse).")
        self.host_bytes_used = add(Gauge, "host_pool_bytes_used", "Host KV pool bytes reserved by sparse "
                                   "requests (their full KV).")
        self.host_usage = add(Gauge, "host_pool_usage_perc", "Fraction of the host KV pool in use.")
        self.prompt_tokens = add(Counter, "prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = add(Counter, "generation_tokens", "Generated tokens.")
        self.prefix_queries = add(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                  "cache at admission (a preempted request's again when it is readmitted).")
        self.prefix_hits = add(Counter, "prefix_cache_hits", "Of those, tokens found cached in GPU pages "
                               "(shared, not prefilled).")
        self.prefix_queries_host = add(Counter, "prefix_cache_queries_host", "Prompt tokens looked up at "
                                       "admission with the host tier on (sparse engines): as prefix_cache_queries.")
        self.prefix_hits_host = add(Counter, "prefix_cache_hits_host", "Of those, tokens found in the host tier "
                                    "past the GPU hits (loaded into pages, not prefilled).")
        self.prefill_computed = add(Counter, "prefill_computed_tokens", "Tokens the prefill steps computed "
                                    "(prompt tokens not found cached, and recomputed ones after preemption).")
        self.preemptions = add(Counter, "num_preemptions", "Requests preempted (KV dropped, recomputed "
                               "later) since the server started.")
        self._success = Counter("oasiskv:request_success", "Finished requests, by finish reason (stop, "
                                "length, abort, error).", ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = add(Histogram, "time_to_first_token_seconds", "Time to first token (arrival in the "
                        "engine to first token).", buckets=_LATENCY_BUCKETS)
        self.tpot = add(Histogram, "time_per_output_token_seconds", "Time per output token after the first, "
                        "per request.", buckets=_TPOT_BUCKETS)
        self.itl = add(Histogram, "inter_token_latency_seconds", "Time between two outputs of one request.",
                       buckets=_TPOT_BUCKETS)
        self.e2el = add(Histogram, "e2e_request_latency_seconds", "End-to-end request latency in the engine.",
                        buckets=_LATENCY_BUCKETS)
        self.queue_time = add(Histogram, "request_queue_time_seconds", "Arrival in the engine to its first "
                              "batch.", buckets=_LATENCY_BUCKETS)
        self.prefill_time = add(Histogram, "request_prefill_time_seconds", "First batch to first token.",
                                buckets=_LATENCY_BUCKETS)
        self.decode_time = add(Histogram, "request_decode_time_seconds", "First token to the last.",
                               buckets=_LATENCY_BUCKETS)
        self.request_prompt_tokens = add(Histogram, "request_prompt_tokens", "Prompt tokens per finished "
                                         "request.", buckets=_TOKEN_BUCKETS)
        self.request_generation_tokens = add(Histogram, "request_generation_tokens", "Generated tokens per "
                                             "finished request.", buckets=_TOKEN_BUCKETS)
        # Sparse requests: counted when a request that decoded sparse finishes.
        self.sparse_requests = add(Counter, "sparse_requests", "Finished requests that decoded sparse.")
        self.sparse_bytes = add(Counter, "sparse_host_to_gpu_bytes", "Host -> GPU bytes fetched into the "
                                "working sets of finished sparse requests.")
        self.sparse_predicted = add(Counter, "sparse_lookahead_predicted_blocks", "(layer, head, block) items "
                                    "the lookahead predicted, finished sparse requests.")
        self.sparse_hits = add(Counter, "sparse_lookahead_hit_blocks", "Predicted items already resident when "
                               "the step needed them.")
        self.sparse_hit_rate = add(Gauge, "sparse_lookahead_hit_rate", "Lookahead hit rate over all finished "
                                   "sparse requests (hits / predicted).")
        self.sparse_drafts = add(Counter, "sparse_draft_tokens", "Lookahead draft tokens proposed for the "
                                 "steps of finished sparse requests.")
        self.sparse_drafts_accepted = add(Counter, "sparse_draft_accepted_tokens", "... of them equal to the "
                                          "token the step then produced.")
        self.sparse_stall = add(Counter, "sparse_pipeline_stall_seconds", "Time the decode steps of finished "
                                "sparse requests waited at the end of the step for the prefetch pipeline's "
                                "streams, summed per request (CUDA only; on CPU the pipeline runs its stages "
                                "in order inside the step and reports 0).")
        # Every sparse decode step, overlapped ones too (its figures are read with its tokens).
        self.step_counters = {key: add(Counter, name, doc) for key, name, doc in (
            ("steps", "sparse_decode_steps", "Decode steps that ran sparse requests."),
            ("foreground_s", "sparse_step_foreground_seconds", "Foreground time of the sparse decode "
             "steps (their layers, before the join with the prefetch streams; CUDA pipeline)."),
            ("stall_s", "sparse_step_stall_seconds", "Pipeline stall of the sparse decode steps: time each "
             "step's foreground waited at its end for the prefetch streams, once per step (CUDA pipeline)."),
            ("bytes", "sparse_step_host_to_gpu_bytes", "Host -> GPU bytes the sparse decode steps admitted."),
            ("budget_bytes", "sparse_step_budget_bytes", "Transfer budgets of the sparse decode steps, summed "
             "(0 with --fetch-budget off); bytes / budget = the budget's use."),
            ("hits", "sparse_step_hit_blocks", "Predicted (layer, head, block) items already on the GPU."),
            ("predicted", "sparse_step_predicted_blocks", "Predicted (layer, head, block) items."))}
        self.conversions = add(Counter, "sparse_conversions", "Requests converted from dense to sparse "
                               "(past the threshold, or instead of a preemption).")
        # Prefill/decode disaggregation (--role prefill|decode; docs/disaggregation.md).
        self.disagg_counters = {key: add(Counter, name, doc) for key, name, doc in (
            ("admission_bytes", "disagg_admission_bytes", "Admission bytes: handed over (prefill role) or "
             "received before the first decode step (decode role: the admissions, and the full transfers' "
             "reads over the transport)."),
            ("admission_transport_bytes", "disagg_admission_transport_bytes", "Decode role: of the admission "
             "bytes, those read over the transport at admission (the full transfer mode's KV)."),
            ("admissions", "disagg_admissions", "Requests handed over (prefill role) or admitted (decode role)."),
            ("remote_bytes", "disagg_remote_read_bytes", "Bytes the decode role read from prefill servers' "
             "host pools after admission."),
            ("remote_reads", "disagg_remote_reads", "Batched remote reads posted (one per prefill peer per step "
             "at most)."),
            ("items_no_room", "disagg_items_no_room", "Decode role: wanted blocks left unread because the host "
             "arena (--remote-kv-gb) was full."),
            ("items_evicted", "disagg_items_evicted", "Decode role: prompt blocks given back from the full host "
             "arena to make room (read again if predicted again)."),
            ("lease_expiries", "disagg_lease_expiries", "Prefill role: leases that ended by expiry (no "
             "heartbeat within the TTL), not by release."),
            ("failed_requests", "disagg_failed_requests", "Decode role: requests failed because their prefill "
             "server failed."))}
        self.disagg_gauges = {key: add(Gauge, name, doc) for key, name, doc in (
            ("reads_in_flight", "disagg_reads_in_flight", "Decode role: batched remote reads in flight."),
            ("leases_held", "disagg_leases_held", "Leases on handed-over requests: held for decode servers "
             "(prefill role) or renewed by this server (decode role)."),
            ("host_bytes_used", "disagg_host_bytes_used", "Decode role: host bytes holding admitted requests' "
             "blocks (what they received, read or wrote)."),
            ("host_bytes_total", "disagg_host_bytes_total", "Decode role: size of that host arena."),
            ("host_bytes_peak", "disagg_host_bytes_peak", "Decode role: the most host bytes that arena held at "
             "once since the server started."))}
        self.disagg_request_host_bytes = add(Histogram, "disagg_request_host_bytes", "Decode role: host bytes "
                                             "a finished admitted request held at once at most.",
                                             buckets=tuple(2.0 ** i for i in range(20, 38)))
        self._seen: dict[str, float] = {}  # engine totals already added to the counters
        self._disagg = None  # a role server's engine.disagg_stats, once the engine thread ran
        self._disagg_lock = threading.Lock()
        self._predicted = self._hits = 0  # running sums behind the hit-rate gauge

    def _add(self, kind, name: str, documentation: str, **kwargs):
        metric = kind("oasiskv:" + name, documentation, ["model_name"], registry=self.registry, **kwargs)
        return metric.labels(model_name=self.model_name)

    def success(self, finished_reason: str):
        return self._success.labels(model_name=self.model_name, finished_reason=finished_reason)

    def set_engine_alive(self, alive: bool) -> None:
        self.engine_alive.set(1 if alive else 0)

    def render(self) -> bytes:
        if self._disagg is not None:  # lease and arena figures change off the engine thread too
            self._observe_disagg(self._disagg)
        return generate_latest(self.registry)

    # ---- fed by the engine thread -------------------------------------------------------
    def observe_engine(self, engine) -> None:
        sched, bm = engine.scheduler, engine.block_manager
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        used = bm.num_pages - bm.num_free
        self.gpu_pages_total.set(bm.num_pages)
        self.gpu_pages_used.set(used)
        self.gpu_usage.set(used / bm.num_pages)
        self.kv_usage.set(used / bm.num_pages)
        for kind, nbytes in engine.gpu_bytes_by_kind().items():
            self.gpu_bytes.labels(self.model_name, kind).set(nbytes)
        self._advance(self.preemptions, "preemptions", getattr(sched, "num_preemptions", 0))
        self._advance(self.prefix_queries, "prefix_queries", bm.queries)
        self._advance(self.prefix_hits, "prefix_hits", bm.hits)
        host_tier = getattr(bm, "host_tier", None)
        if host_tier is not None:
            self._advance(self.prefix_queries_host, "prefix_queries_host", host_tier.queries)
            self._advance(self.prefix_hits_host, "prefix_hits_host", host_tier.hits)
        self._advance(self.prefill_computed, "prefill_computed", engine.step_stats["prefill_tokens"])
        self._disagg = getattr(engine, "disagg_stats", None)
        if self._disagg is not None:
            self._observe_disagg(self._disagg)
        sparse = engine.runner.sparse
        if sparse is not None:
            for key, counter in self.step_counters.items():
                self._advance(counter, key, sparse.totals[key])
            self._advance(self.conversions, "conversions", sparse.num_conversions)
            host = sparse.host
            total = host.num_items * host.item_bytes
            self.host_bytes_total.set(total)
            self.host_bytes_used.set(host.bytes_used)
            self.host_usage.set(host.bytes_used / total if total else 0.0)

    def _observe_disagg(self, disagg_stats) -> None:
        with self._disagg_lock:  # the engine thread and a /metrics handler may both be here
            figures = disagg_stats()
            for key, counter in self.disagg_counters.items():
                self._advance(counter, "disagg_" + key, figures.get(key, 0))
            for key, gauge in self.disagg_gauges.items():
                gauge.set(figures.get(key, 0))

    def _advance(self, counter, key: str, total: float) -> None:
        """Bring a counter up to an engine total (engine totals only grow)."""
        seen = self._seen.get(key, 0)
        if total > seen:
            counter.inc(total - seen)
            self._seen[key] = total

    def observe_output(self, out, since_last: float | None = None) -> None:
        """One output = one new token of one request; `since_last`: seconds since its previous one."""
        self.generation_tokens.inc()
        if len(out.token_ids) == 1:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        if since_last is not None:
            self.itl.observe(since_last)
        if not out.finished:
            return
        self.success(out.finish_reason or "stop").inc()
        m = out.metrics
        for key, histogram in (("ttft", self.ttft), ("e2el", self.e2el), ("queue_time", self.queue_time),
                               ("prefill_time", self.prefill_time), ("decode_time", self.decode_time)):
            if key in m:
                histogram.observe(m[key])
        if len(out.token_ids) > 1 and "tpot" in m:
            self.tpot.observe(m["tpot"])
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(len(out.token_ids))
        st = out.stats
        if st:
            self.sparse_requests.inc()
            self.sparse_bytes.inc(st.get("bytes_to_device", 0))
            self.sparse_predicted.inc(st.get("predicted", 0))
            self.sparse_hits.inc(st.get("hits", 0))
            self._predicted += st.get("predicted", 0)
            self._hits += st.get("hits", 0)
            self.sparse_hit_rate.set(self._hits / self._predicted if self._predicted else 0.0)
            self.sparse_stall.inc(st.get("pipeline_stall_s", 0.0))
            self.sparse_drafts.inc(st.get("drafts", 0))
            self.sparse_drafts_accepted.inc(st.get("drafts_accepted", 0))
            if "disagg_host_bytes" in st:
                self.disagg_request_host_bytes.observe(st["disagg_host_bytes"])

    def observe_abort(self, reason: str = "abort") -> None:
        self.success(reason).inc()
