"""The admission of a disaggregated request, from a real conversion on the default model (a
4K-token prompt, K = 32, the in-line path): the RPF admission's bytes against the full
transfer's, its wire form, and its placement on the decode side, where every other block is
read from the prefill's own host pool and equals it byte for byte."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.disagg.admission import Admission, admit_rpf, full_admission, held_positions, rpf_admission
from oasiskv.disagg.local_items import LocalItems
from oasiskv.disagg.remote_reads import RemoteReads
from oasiskv.disagg.socket_transport import SocketTransport

PROMPT_TOKENS, TOP_K = 4000, 32


@pytest.fixture(scope="module")
def converted():
    llm = LLM(max_model_len=4200, sparse=True, top_k_blocks=TOP_K, sparse_threshold=2048, host_kv_gb=0.5)
    engine = llm.engine
    ids = llm.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)[:PROMPT_TOKENS]
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    seq = engine.seqs[rid]
    while seq.sparse is None:  # the prefill step, then its conversion
        engine.step()
    yield engine, seq
    engine.abort(rid)
    assert engine.runner.sparse.host.bytes_used == 0


def admissions(engine, seq) -> tuple[Admission, Admission]:
    sparse = engine.runner.sparse
    rpf = rpf_admission(seq.request_id, seq, seq.sparse, sparse.kv, sparse.Hkv, sparse.step)
    full = full_admission(seq.request_id, seq, sparse.host.extent_items(seq.host_extent))
    return rpf, full


def test_rpf_admission_is_a_quarter_of_full_or_less(converted):
    engine, seq = converted
    rpf, full = admissions(engine, seq)
    nb = -(-PROMPT_TOKENS // engine.config.block_size)
    assert rpf.tensors["kmin"].shape[1] == nb and full.tensors["kv"].shape[1] == nb
    ratio = rpf.tensor_bytes() / full.tensor_bytes()
    wire = len(rpf.to_bytes()) / len(full.to_bytes())
    print(f"admission bytes: rpf {rpf.tensor_bytes()} full {full.tensor_bytes()} ratio {ratio:.3f} (wire {wire:.3f})")
    assert ratio <= 0.25 and wire <= 0.25
    # The working set's KV is what the GPU slots hold, and equals the host copy of its blocks.
    blocks = rpf.tensors["blocks"]
    layer, head, pos = held_positions(blocks)
    block = blocks[layer, head, pos].long()
    assert torch.equal(rpf.tensors["items"], full.tensors["kv"][layer, block, head])
    assert rpf.first_token == seq.output_token_ids[0] and rpf.num_cached == PROMPT_TOKENS


def test_wire_form_round_trips(converted):
    rpf, _ = admissions(*converted)
    back = Admission.from_bytes(rpf.to_bytes())
    assert back.tensors.keys() == rpf.tensors.keys()
    for k, t in rpf.tensors.items():
        assert torch.equal(back.tensors[k], t), k
    assert (back.request_id, back.first_token, back.draft, back.remote_start, back.remote_stride) == \
        (rpf.request_id, rpf.first_token, rpf.draft, rpf.remote_start, rpf.remote_stride)
    assert back.prompt_token_ids == rpf.prompt_token_ids


def test_decode_side_reads_the_rest_once(converted):
    """The prefill's host pool served by a transport in this process: the decode side places the
    working set, reads every other complete block once, and holds the prefill's bytes."""
    engine, seq = converted
    host = engine.runner.sparse.host
    rpf, _ = admissions(engine, seq)
    owner = SocketTransport()
    owner.register(host.items)
    owner.serve()
    store = LocalItems(40_000, engine.config.block_size, host.head_dim, host.dtype)
    reader = SocketTransport()
    reader.register(store.items)
    reads = RemoteReads(reader, store)
    try:
        peer = reader.add_peer(owner.metadata())
        max_blocks = seq.host_extent.max_blocks
        state = admit_rpf(Admission.from_bytes(rpf.to_bytes()), reads, peer, max_blocks)
        placed = store.bytes_used
        assert placed == rpf.tensors["items"].numel() * rpf.tensors["items"].element_size()
        L, _, H = state.remote.where.shape
        complete = PROMPT_TOKENS // engine.config.block_size
        for layer in range(L):  # as the stages would ask, layer by layer, one flush per step
            reads.want(state.remote, layer, np.arange(max_blocks)[:, None], np.arange(H)[None, :])
        reads.flush()
        reads.wait()
        assert reads.totals.reads == 1
        held = (state.remote.where[:, :complete] >= 0).sum()
        assert held == L * complete * H  # every complete block is local now
        assert reads.totals.bytes_read == store.bytes_used - placed  # placed ones were not read
        src = host.extent_items(seq.host_extent)
        where = torch.from_numpy(state.remote.where[:, :complete])
        assert torch.equal(store.items[where.reshape(-1)].view(src[:, :complete].shape), src[:, :complete])
        assert torch.equal(state.kmin[:, :complete], rpf.tensors["kmin"][:, :complete])
    finally:
        reads.release(state.remote)
        reads.poll()
        assert store.bytes_used == 0
        reader.close()
        owner.close()
