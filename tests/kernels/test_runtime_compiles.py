"""Triton compilations after start-up are counted and logged, and the hooks already set stay
in the chain; the conversion's warm-up runs the conversion's own prediction call."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from oasiskv.engine.runtime_compiles import RuntimeCompiles
from oasiskv.sparse.config import SparseConfig
from oasiskv.sparse.manager import SparseManager


def test_compiles_are_counted_logged_and_earlier_hooks_still_run(caplog):
    calls = []
    watcher = RuntimeCompiles()
    watcher._before_prev = lambda **kw: calls.append(("before", kw["fn"].name))
    watcher._after_prev = lambda **kw: calls.append(("after", kw["fn"].name))
    fn = SimpleNamespace(module="oasiskv.kernels.some_kernel", name="_kernel")
    with caplog.at_level(logging.INFO, logger="oasiskv.engine.runtime_compiles"):
        assert not watcher._before(fn=fn)  # a true answer would skip the compilation
        watcher._after(fn=fn)
    assert watcher.count == 1 and watcher.seconds >= 0
    assert calls == [("before", "_kernel"), ("after", "_kernel")]
    assert "oasiskv.kernels.some_kernel._kernel" in caplog.text


def test_install_sets_tritons_hooks_after_the_ones_there():
    from triton import knobs
    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    earlier = lambda **kw: None  # noqa: E731
    knobs.runtime.jit_cache_hook = earlier
    try:
        watcher = RuntimeCompiles()
        assert watcher.install()
        assert knobs.runtime.jit_cache_hook == watcher._before
        assert knobs.runtime.jit_post_compile_hook == watcher._after
        assert watcher._before_prev is earlier
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved


def test_conversion_warm_up_scans_the_engines_width(monkeypatch):
    mc = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8, group_size=2)
    cfg = SparseConfig(enabled=True, top_k_blocks=4, sink_blocks=1, window_blocks=2, host_kv_gb=0.001)
    m = SparseManager(cfg, mc, torch.zeros(2, 4, 2, 16, 8), block_size=16)
    m.scan_blocks = 40
    seen = {}

    def score_topk(q, kmin, kmax, offsets, num_blocks, group_size, k, max_blocks, **kw):
        seen.update(q=tuple(q.shape), summaries=tuple(kmin.shape), max_blocks=max_blocks, k=k)
        return torch.full((q.shape[0], kmin.shape[1], k), -1, dtype=torch.int32), None

    monkeypatch.setattr("oasiskv.sparse.manager.score_topk", score_topk)
    m.warm_up_conversion(torch.float32)
    assert seen == dict(q=(2, 4, 8), summaries=(2 * 40, 2, 8), max_blocks=40, k=4)


def test_conversion_warm_up_runs_the_real_prediction():
    mc = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8, group_size=2)
    cfg = SparseConfig(enabled=True, top_k_blocks=4, sink_blocks=1, window_blocks=2, host_kv_gb=0.001)
    m = SparseManager(cfg, mc, torch.zeros(2, 4, 2, 16, 8), block_size=16)
    m.scan_blocks = 40
    m.warm_up_conversion(torch.float32)
