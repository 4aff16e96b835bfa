"""The batched lookahead pipeline (device-resident state, stages as tensor work, rows of
many requests) against the in-line per-request reference (tests/inline_reference.py), through
the whole engine on the real default model: with a small budget (eviction and the cap at work),
two requests batched, one finishing before the other (its row is released and the other moves
into it), both paths decode the same tokens and count the same hits, admissions, evictions and
bytes."""
import argparse

import pytest
import torch

from inline_reference import inline_llm

from oasiskv import LLM, SamplingParams
from oasiskv.sparse.tuning import PipelineTuning

BUDGET = dict(max_model_len=768, sparse=True, top_k_blocks=8, window_blocks=2, sink_blocks=1,
              sparse_threshold=256, fetch_ratio=0.25, host_kv_gb=0.25)


@pytest.mark.slow
@pytest.mark.parametrize("drafter,temperature,deferred,narrow", [("prev", 0, 0, False), ("self", 0.8, 0, False),
                                                                 ("self", 0, 3, True), ("oracle", 0.8, 2, False),
                                                                 ("ondemand", 0, 0, False)])
def test_pipeline_matches_inline_path(drafter, temperature, deferred, narrow):
    """deferred: the last layers' transfers and the write-through open the next step (as on
    CUDA, in order here): they wait a step, and land before rows move when a request finishes.
    The host pools end equal too: every block either path completed was written through.
    narrow: the prediction scans the narrowest width that holds the step's requests (widths
    16, 32, 48 blocks here), not the model's length. The evaluation's baselines are modes of the
    pipeline's step: the oracle's first pass (its K/V write and key fold repeated by the step),
    and on-demand retrieval before each layer's attention."""
    tuning = PipelineTuning(deferred_layers=deferred, scan_bucket_blocks=16 if narrow else 512)
    text = open(argparse.__file__).read()
    runs, pools = {}, {}
    for path in ("off", "on"):  # off: the in-line reference (tests/inline_reference.py)
        build = LLM if path == "on" else inline_llm
        llm = build(drafter=drafter, pipeline_tuning=tuning, **BUDGET)
        if path == "on":
            p = llm.engine.runner.pipeline
            flush, checked = p.flush_deferred, []

            def checked_flush():  # rows are about to change: every resident block must be in place
                flush()
                checked.append(resident_blocks_hold_host_data(p))
            p.flush_deferred = checked_flush
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        prompts = [ids[:400], ids[3000:3330]]
        # 17 tokens: the first request's last step completes a block (position 415), so with
        # deferral its write-through is left to the flush at its release.
        params = [SamplingParams(temperature=temperature, max_tokens=17, ignore_eos=True, seed=1),
                  SamplingParams(temperature=temperature, max_tokens=28, ignore_eos=True, seed=2)]
        pools[path] = llm.engine.runner.sparse.host.items
        pools[path].zero_()  # never-written items hold whatever the memory held
        runs[path] = llm.generate(prompts, params)
        if path == "on":
            assert llm.engine.runner.pipeline is not None and llm.engine.runner.pipeline.num_rows == 0
    assert checked and all(checked)
    if narrow:  # the steps ran at widths below the model's 48 blocks
        assert {scan for _, scan in llm.engine.runner.sparse_runner.pipeline_steps} == {32}
    assert torch.equal(pools["on"], pools["off"])
    for ref, got in zip(runs["off"], runs["on"]):
        assert got.token_ids == ref.token_ids
        keys = ["sparse_steps", "predicted", "hits", "admitted", "evicted", "bytes_to_device", "draft_acceptance"]
        assert {k: got.stats[k] for k in keys} == {k: ref.stats[k] for k in keys}
    assert runs["on"][1].stats["admitted"] > 0 and runs["on"][1].stats["evicted"] > 0


def resident_blocks_hold_host_data(p) -> bool:
    """Every dynamic slot of every used row holds, in the GPU pool, the host pool's copy of the
    block the pipeline's state says it holds."""
    S, K, H, L = p.S, p.K, p.H, p.L
    layer = torch.arange(L)[:, None, None]
    head = torch.arange(H)[None, :, None]
    for r in range(p.num_rows):
        blocks = p.resident[:, r * H:(r + 1) * H].long()  # [L, H, K]
        held = blocks >= 0
        slots = (p.pages[r, S:S + K].long()[None, None, :] * H + head).expand(L, H, K)
        items = int(p.extent_start[r]) + (layer * int(p.extent_blocks[r]) + blocks) * H + head
        gpu = p.kv[layer.expand(L, H, K)[held], slots[held]]
        if not torch.equal(gpu, p.host.items[items[held]]):
            return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("temperature,deferred", [(0.8, 0), (0, 3)])
def test_async_pipeline_steps_match_sync(temperature, deferred):
    """Async scheduling of sparse steps (step t+1 launched on step t's samples and device-chosen
    drafts, before the host reads them) decodes what the synchronous loop decodes, with the
    same draft acceptance, while one request finishes with the next step already in flight
    (deferred: with the last layers' transfers opening the next step, in both loops)."""
    text = open(argparse.__file__).read()
    runs = {}
    for mode in ("off", "on"):
        llm = LLM(async_scheduling=mode, pipeline_tuning=PipelineTuning(deferred_layers=deferred),
                  **BUDGET)
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        prompts = [ids[:400], ids[3000:3330], ids[9000:9300]]
        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
                  for i, n in enumerate((12, 28, 20))]
        runs[mode] = llm.generate(prompts, params)
        if mode == "on":
            assert llm.engine.step_stats["overlapped_steps"] > 0
            assert llm.engine.runner.pipeline.num_rows == 0
    for ref, got in zip(runs["off"], runs["on"]):
        assert got.token_ids == ref.token_ids
        keys = ["sparse_steps", "predicted", "hits", "admitted", "evicted", "draft_acceptance"]
        assert {k: got.stats[k] for k in keys} == {k: ref.stats[k] for k in keys}


@pytest.mark.slow
def test_async_pipeline_stop_token_and_abort_in_flight():
    """Under async scheduling a request that stops on a token (unknown until read: the next
    step already runs it) and one aborted mid-run leave their rows while a step is in flight;
    the others decode what they decode synchronously and every row and page comes back."""
    text = open(argparse.__file__).read()
    outs = {}
    for mode in ("off", "on"):
        llm = LLM(async_scheduling=mode, **BUDGET)
        eng = llm.engine
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        prompts = [ids[:400], ids[3000:3330], ids[9000:9300]]
        greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        probe = llm.generate(prompts[:1], greedy)[0].token_ids  # a token the first request will emit
        stop = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[probe[9]])
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, [stop, greedy, greedy])]
        got = {}
        for i in range(200):
            if i == 12:
                eng.abort(rids[2])
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = (o.token_ids, o.finish_reason)
            if not eng.has_unfinished():
                break
        assert rids[2] not in got and got[rids[0]][1] == "stop"
        assert eng.runner.pipeline.num_rows == 0 and eng.block_manager.num_free == eng.block_manager.num_pages
        if mode == "on":
            assert eng.step_stats["overlapped_steps"] > 0
        outs[mode] = [got[rids[0]], got[rids[1]]]
    assert outs["on"] == outs["off"]


@pytest.mark.slow
def test_every_layer_offers_its_fork_points_in_order(monkeypatch):
    """Each layer of a sparse step offers the pipeline the points its stages may start from,
    epilogue, attention, o_proj, mlp, in order (`PipelineTuning.stages_fork` picks one on CUDA streams;
    on CPU the stages run in-line at the attention, so the tokens cannot depend on it)."""
    from oasiskv.sparse.pipeline import LookaheadPipeline
    from oasiskv.sparse.tuning import STAGE_FORKS

    seen, real = [], LookaheadPipeline.fork_point

    def spy(self, layer, part):
        seen.append((layer, part))
        return real(self, layer, part)

    monkeypatch.setattr(LookaheadPipeline, "fork_point", spy)
    llm = LLM(**BUDGET)
    ids = llm.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)[:400]
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    L = llm.engine.runner.model.config.num_layers
    order = ("epilogue", "attention", "o_proj", "mlp")
    assert sorted(order) == sorted(STAGE_FORKS)
    per_step = [(layer, part) for layer in range(L) for part in order]
    assert seen and len(seen) % len(per_step) == 0
    assert seen == per_step * (len(seen) // len(per_step))


@pytest.mark.slow
def test_pipeline_request_runs_to_the_model_length():
    """A sparse request decodes on the pipeline until `max_model_len` (its last steps' scan is the
    model's full width, not beyond it) and ends with "length"."""
    llm = LLM(**BUDGET)
    ids = llm.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)[:740]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(ids) + len(out.token_ids) == BUDGET["max_model_len"]
    assert out.stats["sparse_steps"] > 0
