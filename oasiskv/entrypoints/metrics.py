"""Prometheus metrics of the server (`GET /metrics`), named after vLLM's with an `oasiskv:` prefix.

Gauges are refreshed by the engine thread after every step; counters and histograms are fed
as outputs leave the engine. Each server owns its registry, so several can live in one process.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "oasiskv:"
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting for pages or host-pool room.",
                             registry=r)
        self.gpu_pages_total = Gauge(p + "gpu_pages_total", "KV pages in the GPU pool.", registry=r)
        self.gpu_pages_used = Gauge(p + "gpu_pages_used", "KV pages held by requests (dense page tables "
                                    "and sparse working sets).", registry=r)
        self.gpu_usage = Gauge(p + "gpu_cache_usage_perc", "Fraction of GPU KV pages in use (1 = full).",
                               registry=r)
        self.host_bytes_total = Gauge(p + "host_pool_bytes_total", "Size of the host KV pool (0 without "
                                      "--sparse).", registry=r)
        self.host_bytes_used = Gauge(p + "host_pool_bytes_used", "Host KV pool bytes reserved by sparse "
                                     "requests (their full KV).", registry=r)
        self.host_usage = Gauge(p + "host_pool_usage_perc", "Fraction of the host KV pool in use.", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prefilled prompt tokens.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens.", registry=r)
        self.success = Counter(p + "request_success", "Finished requests, by finish reason "
                               "(stop, length, abort).", ["finished_reason"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token (arrival in the "
                              "engine to first token).", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Time per output token after the "
                              "first, per request.", buckets=_TPOT_BUCKETS, registry=r)
        self.e2el = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency in the "
                              "engine.", buckets=_LATENCY_BUCKETS, registry=r)
        # Sparse requests: counted when a request that decoded sparse finishes.
        self.sparse_requests = Counter(p + "sparse_requests", "Finished requests that decoded sparse.",
                                       registry=r)
        self.sparse_bytes = Counter(p + "sparse_host_to_gpu_bytes", "Host -> GPU bytes fetched into the "
                                    "working sets of finished sparse requests.", registry=r)
        self.sparse_predicted = Counter(p + "sparse_lookahead_predicted_blocks", "(layer, head, block) "
                                        "items the lookahead predicted, finished sparse requests.", registry=r)
        self.sparse_hits = Counter(p + "sparse_lookahead_hit_blocks", "Predicted items already resident "
                                   "when the step needed them.", registry=r)
        self.sparse_hit_rate = Gauge(p + "sparse_lookahead_hit_rate", "Lookahead hit rate over all "
                                     "finished sparse requests (hits / predicted).", registry=r)
        self.sparse_stall = Counter(p + "sparse_pipeline_stall_seconds", "Time the decode steps of finished "
                                    "sparse requests waited at the end of the step for the prefetch "
                                    "pipeline's streams, summed per request (CUDA pipeline only; the in-line "
                                    "path on CPU runs its stages inside the step and reports 0).", registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Requests preempted (KV dropped, recomputed "
                                   "later) since the server started.", registry=r)
        # Every sparse decode step, overlapped ones too (its figures are read with its tokens).
        self.step_counters = {key: Counter(p + name, doc, registry=r) for key, name, doc in (
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
        self.conversions = Counter(p + "sparse_conversions", "Requests converted from dense to sparse "
                                   "(past the threshold, or instead of a preemption).", registry=r)
        self._seen: dict[str, float] = {}  # engine totals already added to the counters
        self._predicted = self._hits = 0  # running sums behind the hit-rate gauge

    def render(self) -> bytes:
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
        self._advance(self.preemptions, "preemptions", getattr(sched, "num_preemptions", 0))
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

    def _advance(self, counter: Counter, key: str, total: float) -> None:
        """Bring a counter up to an engine total (engine totals only grow)."""
        seen = self._seen.get(key, 0)
        if total > seen:
            counter.inc(total - seen)
            self._seen[key] = total

    def observe_output(self, out) -> None:
        """One output = one new token of one request."""
        self.generation_tokens.inc()
        if len(out.token_ids) == 1:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        if not out.finished:
            return
        self.success.labels(finished_reason=out.finish_reason or "stop").inc()
        m = out.metrics
        if "ttft" in m:
            self.ttft.observe(m["ttft"])
        if "e2el" in m:
            self.e2el.observe(m["e2el"])
        if len(out.token_ids) > 1 and "tpot" in m:
            self.tpot.observe(m["tpot"])
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

    def observe_abort(self) -> None:
        self.success.labels(finished_reason="abort").inc()
