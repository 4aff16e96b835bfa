"""A line of engine statistics every few seconds (vLLM's "Avg prompt throughput ..." log), with
the figures of the sparse path beside: how fast the engine ran over the last interval, what it
held, and where a decode step's time went. The server logs it from the engine thread."""
from __future__ import annotations

import logging
import time

log = logging.getLogger("oasiskv.stats")


class StatLogger:
    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self._last = time.monotonic()
        self._seen: dict[str, float] = {}

    def maybe_log(self, engine) -> str | None:
        """Log (and return) the line for the interval just ended, once `interval` has passed."""
        now = time.monotonic()
        if now - self._last < self.interval:
            return None
        window, self._last = now - self._last, now
        totals = self._totals(engine)
        d = {k: v - self._seen.get(k, 0) for k, v in totals.items()}
        self._seen = totals
        sched, bm = engine.scheduler, engine.block_manager
        sparse_running = sum(s.sparse is not None for s in sched.running)
        parts = [f"Avg prompt throughput: {d['prefill_tokens'] / window:.1f} tokens/s",
                 f"Avg generation throughput: {d['decode_tokens'] / window:.1f} tokens/s",
                 f"Running: {len(sched.running)} reqs ({sparse_running} sparse)",
                 f"Waiting: {len(sched.waiting)} reqs",
                 f"GPU KV cache usage: {100 * (bm.num_pages - bm.num_free) / bm.num_pages:.1f}%"]
        if d["prefix_queries"]:
            parts.append(f"Prefix cache hit rate: {100 * d['prefix_hits'] / d['prefix_queries']:.1f}%")
        if d.get("prefix_queries_host"):
            parts.append(f"host tier: {100 * d['prefix_hits_host'] / d['prefix_queries_host']:.1f}%")
        if d["decode_steps"]:
            parts.append(f"decode step: {1e3 * d['decode_time'] / d['decode_steps']:.2f} ms "
                         f"x {d['decode_steps']:.0f} ({100 * d['overlapped_steps'] / d['decode_steps']:.0f}% overlapped)")
        if d["prefill_steps"]:
            parts.append(f"prefill step: {1e3 * d['prefill_time'] / d['prefill_steps']:.1f} ms x {d['prefill_steps']:.0f}")
        if d.get("steps"):
            busy = d["foreground_s"] + d["stall_s"]
            mb = d["bytes"] / d["steps"] / 1e6
            moved = f"{mb:.0f} MB/step"
            if d.get("budget_bytes"):  # the pipeline's budget (auto: it shrinks while steps stall)
                moved = f"{mb:.0f} of a {d['budget_bytes'] / d['steps'] / 1e6:.0f} MB/step budget"
            parts.append(f"sparse steps: {d['steps']:.0f}, foreground {1e3 * d['foreground_s'] / d['steps']:.2f} ms, "
                         f"stall {100 * d['stall_s'] / busy if busy else 0:.1f}%, {moved}")
        if d.get("conversions"):
            parts.append(f"conversions: {d['conversions']:.0f}")
        if d.get("preemptions"):
            parts.append(f"preemptions: {d['preemptions']:.0f}")
        line = ", ".join(parts)
        log.info(line)
        return line

    @staticmethod
    def _totals(engine) -> dict[str, float]:
        totals = dict(engine.step_stats)
        totals["preemptions"] = getattr(engine.scheduler, "num_preemptions", 0)
        totals["prefix_queries"] = engine.block_manager.queries
        totals["prefix_hits"] = engine.block_manager.hits
        host_tier = getattr(engine.block_manager, "host_tier", None)
        if host_tier is not None:
            totals["prefix_queries_host"], totals["prefix_hits_host"] = host_tier.queries, host_tier.hits
        sparse = engine.runner.sparse
        if sparse is not None:
            totals.update(sparse.totals)
            totals["conversions"] = sparse.num_conversions
        return totals
