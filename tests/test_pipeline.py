"""The batched lookahead pipeline (issue 4: GPU-resident state, stages as tensor work) against the
per-request sparse path of the engine, on the real default model: from the same converted
request, both decode the same tokens, keep the same blocks and move the same bytes."""
import argparse

import torch

from oasiskv import LLM, SamplingParams
from oasiskv.sparse.decode_step import SparseDecodeStep
from oasiskv.sparse.drafters import next_draft
from oasiskv.sparse.pipeline import LookaheadPipeline

STEPS = 24  # crosses at least one block boundary (write-through) at block size 16


def test_pipeline_matches_per_request_path():
    llm = LLM(max_model_len=512, sparse=True, top_k_blocks=8, window_blocks=2, sink_blocks=1,
              sparse_threshold=256, fetch_ratio=0.25, host_kv_gb=0.25)
    eng, runner = llm.engine, llm.engine.runner
    m, mc = runner.sparse, runner.model_config
    ids = llm.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)[:400]
    rid = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=STEPS + 1, ignore_eos=True))
    seq = eng.seqs[rid]
    while seq.sparse is None:
        eng.step()
    ws = seq.sparse
    S, K = m.cfg.sink_blocks, m.cfg.top_k_blocks
    snap = dict(kv=runner.kv.clone(), host=m.host.items.clone(), blocks=ws.blocks.clone(),
                last=ws.last_selected.clone(), kmin=ws.kmin.clone(), kmax=ws.kmax.clone(),
                step=m.step, tokens=list(seq.token_ids), cached=seq.num_tokens - 1)

    while eng.has_unfinished():  # path A: the engine's per-request path
        eng.step()
    want_tokens = seq.output_token_ids[1:]
    want_resident, want_host, want_stats = ws.blocks[:, :, S:S + K].clone(), m.host.items.clone(), ws.stats

    runner.kv.copy_(snap["kv"])  # path B: the pipeline, from the same state
    m.host.items.copy_(snap["host"])
    ext = ws.extent
    p = LookaheadPipeline(m.cfg, mc, runner.kv, m.host, max_rows=1, max_blocks=ext.max_blocks,
                          summary_blocks=ext.max_blocks, block_size=runner.block_size)
    p.bind(0, ws.pages, ext, summary_offset=0)
    p.resident[:, :] = snap["blocks"][:, :, S:S + K]
    p.last[:, :] = snap["last"].int()
    p.kmin[:, :ext.max_blocks] = snap["kmin"]
    p.kmax[:, :ext.max_blocks] = snap["kmax"]
    p.cached[0], p.active[0], p.step[()] = snap["cached"], True, snap["step"]
    step = SparseDecodeStep(runner.model, runner.kv_caches, p, mc.max_position_embeddings, use_graph=False)
    tokens, draft, got = snap["tokens"], None, []
    for _ in range(STEPS):
        tok = tokens[-1]
        logits = runner.model.compute_logits(step.run(torch.tensor([tok, draft if draft is not None else tok])))
        new, draft_argmax = int(logits[0].argmax()), int(logits[1].argmax())
        tokens = tokens + [new]
        draft = next_draft("self", tokens, draft, new, draft_argmax)
        got.append(new)

    assert got == want_tokens
    assert torch.equal(p.resident.view_as(want_resident), want_resident)
    hits, missed, admitted, evicted = p.stats.sum(0).tolist()
    assert (hits, admitted, evicted) == (want_stats.hits, want_stats.admitted, want_stats.evicted)
    assert hits + missed == want_stats.predicted and admitted > 0 and evicted > 0
    assert p.fetched_bytes == want_stats.bytes_to_device
    assert torch.equal(m.host.items, want_host)  # write-through wrote the same completed blocks
