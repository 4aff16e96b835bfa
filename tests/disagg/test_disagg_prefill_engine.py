"""The prefill role's engine: a hand-over that fails ends only its own request, and the role
servers' sparse paths: the pipeline, its stages in order and eager with --rpf-strict."""
from __future__ import annotations

import argparse

import pytest

import oasiskv.disagg.prefill_engine as prefill_engine
from oasiskv import SamplingParams
from oasiskv.config import EngineConfig
from oasiskv.disagg.socket_transport import SocketTransport
from oasiskv.entrypoints.disagg_args import role_config


@pytest.mark.parametrize("role,strict", [("prefill", False), ("decode", True), ("decode", False)])
def test_role_servers_sparse_paths(role, strict):
    cfg = role_config(EngineConfig(async_scheduling="on"), role, strict)
    assert (cfg.sparse.enabled, cfg.async_scheduling) == (True, "off")
    assert (cfg.pipeline_tuning.background, cfg.enforce_eager) == ((False, True) if strict else (None, False))


@pytest.mark.slow
def test_a_failed_hand_over_fails_only_its_request(monkeypatch):
    engine = prefill_engine.PrefillEngine(
        EngineConfig.from_flat(max_model_len=1200, sparse=True, top_k_blocks=8, sparse_threshold=512, host_kv_gb=0.2),
        SocketTransport())
    try:
        ids = engine.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)[:1000]
        params = SamplingParams(temperature=0, max_tokens=1)
        real = prefill_engine.hand_over

        def broken(*args, **kwargs):
            raise RuntimeError("no admission")

        def run(rid):
            engine.expect_hand_over(rid)
            engine.add_request(ids, params, rid)
            while True:
                for out in engine.step():
                    if out.request_id == rid and out.finished:
                        return out

        monkeypatch.setattr(prefill_engine, "hand_over", broken)
        failed = run("a")
        assert failed.finish_reason == "error" and "hand-over failed" in failed.error
        assert engine.sparse.host.bytes_used == 0 and engine.take_admission("a", "decode-0") is None
        monkeypatch.setattr(prefill_engine, "hand_over", real)
        served = run("b")
        assert served.finish_reason == "length" and engine.take_admission("b", "decode-0") is not None
    finally:
        engine.close()


@pytest.mark.slow
def test_hand_overs_beyond_the_pool_wait_for_pages():
    """More hand-overs at once than the pool can convert together: each waits for the pages of
    its conversion (working set and summaries) and every one is handed over, none fails."""
    engine = prefill_engine.PrefillEngine(
        EngineConfig.from_flat(max_model_len=1200, sparse=True, top_k_blocks=8, sparse_threshold=512, host_kv_gb=0.2,
                               kv_cache_gb=0.03, max_num_seqs=16), SocketTransport())  # (few pipeline rows: pages stay)
    try:
        pool, n = engine.block_manager.num_pages, 12
        assert n * engine.sparse.cfg.working_set_blocks > 2 * pool  # they cannot all convert at once
        ids = engine.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)
        for i in range(n):
            engine.expect_hand_over(f"r{i}")
            engine.add_request(ids[i:i + 60 + i], SamplingParams(temperature=0, max_tokens=1), f"r{i}")
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert sorted(o.finish_reason for o in outs.values()) == ["length"] * n, [o.error for o in outs.values()]
        assert all(engine.take_admission(f"r{i}", "decode-0") is not None for i in range(n))
        assert engine.block_manager.num_free == pool
    finally:
        engine.close()
