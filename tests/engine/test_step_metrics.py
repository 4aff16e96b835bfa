"""Every sparse step's figures and the preemptions reach /metrics as counters that follow the
engine's totals (which the engine adds to on every step, overlapped ones too)."""
from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from oasiskv.entrypoints.metrics import ServerMetrics
from oasiskv.sparse.manager import STEP_TOTALS


def fake_engine(preemptions: int, totals: dict, conversions: int, prefix=(0, 0, 0)):
    """prefix: (tokens looked up in the prefix cache, found there, prefilled)."""
    host = SimpleNamespace(num_items=10, item_bytes=8, bytes_used=16)
    sparse = SimpleNamespace(totals=totals, num_conversions=conversions, host=host)
    return SimpleNamespace(scheduler=SimpleNamespace(running=[], waiting=[], num_preemptions=preemptions),
                           block_manager=SimpleNamespace(num_pages=4, num_free=4, queries=prefix[0], hits=prefix[1]),
                           runner=SimpleNamespace(sparse=sparse), step_stats={"prefill_tokens": prefix[2]},
                           gpu_bytes_by_kind=lambda: {"weights": 1})


def scraped(metrics: ServerMetrics) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}


def test_step_counters_follow_the_engine_totals():
    m = ServerMetrics()
    totals = dict.fromkeys(STEP_TOTALS, 0)
    m.observe_engine(fake_engine(0, dict(totals), 0))
    totals.update(steps=3, foreground_s=0.03, stall_s=0.001, bytes=4096, budget_bytes=8192, hits=5, predicted=9)
    m.observe_engine(fake_engine(2, dict(totals), 1))
    totals.update(steps=5, stall_s=0.0015, bytes=6144)
    m.observe_engine(fake_engine(2, dict(totals), 1))
    v = scraped(m)
    assert v["oasiskv:num_preemptions_total"] == 2
    assert v["oasiskv:sparse_conversions_total"] == 1
    assert v["oasiskv:sparse_decode_steps_total"] == 5
    assert abs(v["oasiskv:sparse_step_stall_seconds_total"] - 0.0015) < 1e-12
    assert v["oasiskv:sparse_step_host_to_gpu_bytes_total"] == 6144
    assert v["oasiskv:sparse_step_budget_bytes_total"] == 8192
    assert v["oasiskv:sparse_step_hit_blocks_total"] == 5 and v["oasiskv:sparse_step_predicted_blocks_total"] == 9


def test_prefix_cache_counters_follow_the_block_manager():
    m = ServerMetrics()
    totals = dict.fromkeys(STEP_TOTALS, 0)
    m.observe_engine(fake_engine(0, totals, 0, (100, 0, 100)))
    m.observe_engine(fake_engine(0, totals, 0, (300, 160, 140)))
    v = scraped(m)
    assert v["oasiskv:prefix_cache_queries_total"] == 300 and v["oasiskv:prefix_cache_hits_total"] == 160
    assert v["oasiskv:prefill_computed_tokens_total"] == 140


def test_host_tier_counters_follow_its_cache():
    m = ServerMetrics()
    totals = dict.fromkeys(STEP_TOTALS, 0)
    for queries, hits in ((100, 0), (300, 120)):
        engine = fake_engine(0, totals, 0, (queries, 40, 0))
        engine.block_manager.host_tier = SimpleNamespace(queries=queries, hits=hits)
        m.observe_engine(engine)
    v = scraped(m)
    assert v["oasiskv:prefix_cache_queries_host_total"] == 300 and v["oasiskv:prefix_cache_hits_host_total"] == 120
    assert v["oasiskv:prefix_cache_hits_total"] == 40  # the GPU tier's, apart
