"""A disaggregated request decoded end to end on two engines in this process (the default
model, a 4K-token prompt, K = 32, the in-line path): the prefill engine converts it and serves
its host pool over the socket transport; the decode engine admits the RPF admission and reads
the rest on demand. With strict reads its greedy tokens equal the prefill engine's own sparse
decode of the same request (colocated); without, they arrive a step later and the decode side
still holds only a fraction of the full KV."""
from __future__ import annotations

import argparse

import pytest

from oasiskv import LLM, SamplingParams
from oasiskv.disagg.admission import Admission, full_admission, rpf_admission
from oasiskv.disagg.decode_side import RemoteSource, admit
from oasiskv.disagg.local_items import LocalItems
from oasiskv.disagg.remote_reads import RemoteReads
from oasiskv.disagg.socket_transport import SocketTransport

PROMPT_TOKENS, TOP_K, NEW_TOKENS = 4000, 32, 24
CONFIG = dict(max_model_len=4200, sparse=True, top_k_blocks=TOP_K, sparse_threshold=2048, host_kv_gb=0.5)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prefill():
    """The prefill engine with one converted request, its admissions, and its own tokens."""
    llm = LLM(**CONFIG)
    engine, sparse = llm.engine, llm.engine.runner.sparse
    ids = llm.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)[:PROMPT_TOKENS]
    rid = engine.add_request(ids, GREEDY)
    seq = engine.seqs[rid]
    while seq.sparse is None:
        engine.step()
    rpf = rpf_admission(rid, seq, seq.sparse, sparse.kv, sparse.Hkv, sparse.step)
    full = full_admission(rid, seq, sparse.host.extent_items(seq.host_extent))
    owner = SocketTransport()
    owner.register(sparse.host.items)
    owner.serve()
    yield engine, seq, Admission.from_bytes(rpf.to_bytes()), full, owner
    owner.close()


@pytest.fixture(scope="module")
def decode():
    llm = LLM(**CONFIG)
    return llm.engine


def run_decode(engine, adm: Admission, owner: SocketTransport, strict: bool):
    sparse = engine.runner.sparse
    store = LocalItems(20_000, sparse.block_size, sparse.D, sparse.dtype)
    reader = SocketTransport()
    reader.register(store.items)
    reads = RemoteReads(reader, store)
    sparse.remote = RemoteSource(reads, sparse.L, strict=strict)
    peer = reader.add_peer(owner.metadata())
    seq = admit(engine, adm, peer, GREEDY)
    held_at_admission = store.bytes_used
    out, peak = None, 0
    while out is None:
        for o in engine.step():
            if o.finished:
                out = o
        peak = max(peak, store.bytes_used)
    reads.poll()
    reader.close()
    assert store.bytes_used == 0, "the decode side's host items must all be back"
    return out, reads.totals, held_at_admission, peak, seq


def test_strict_rpf_equals_colocated_sparse_decode(prefill, decode):
    engine, seq, adm, full, owner = prefill
    out, totals, held, peak, _ = run_decode(decode, adm, owner, strict=True)
    while not seq.is_finished:  # the same request, decoded where it was prefilled
        engine.step()
    assert out.token_ids == seq.output_token_ids
    assert totals.bytes_read > 0  # the working set moved: blocks were read remotely
    full_bytes = full.tensor_bytes()
    print(f"strict: admission {adm.tensor_bytes()} B (full {full_bytes}), remote reads {totals.reads} "
          f"({totals.bytes_read} B, {totals.extents} extents), decode-side host peak {peak} B")
    assert adm.tensor_bytes() <= full_bytes / 4
    assert peak < full_bytes


def test_lazy_reads_arrive_next_step_batched(prefill, decode):
    _, _, adm, full, owner = prefill
    adm.request_id = "lazy"
    out, totals, held, peak, _ = run_decode(decode, adm, owner, strict=False)
    assert len(out.token_ids) == NEW_TOKENS
    steps = NEW_TOKENS - 1
    assert 0 < totals.reads <= steps  # at most one read per step (one peer)
    print(f"lazy: remote reads {totals.reads} over {steps} steps ({totals.bytes_read} B), "
          f"decode-side host peak {peak} B of full {full.tensor_bytes()} B")
    assert peak < full.tensor_bytes()
