"""A disaggregated request end to end on two engines in this process (the default model, a
4K-token prompt, K = 32, the pipeline in order). The prefill engine converts it and hands it over:
its admission, and its host extent leased and served over the socket transport. The decode
engine admits it and reads the rest on demand. With strict reads its greedy tokens equal the
prefill engine's own sparse decode of the request (colocated); without, blocks arrive a step
later, in one read per peer per step, and a dead peer fails only its own request. The full
transfer reads every prompt block over the same transport before the first step, in capped
reads, and decodes the colocated tokens too."""
from __future__ import annotations

import argparse
import time

import numpy as np
import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.config import EngineConfig
from oasiskv.disagg.admission import Admission, admit_rpf, full_admission, held_positions
from oasiskv.disagg.decode_engine import DecodeEngine
from oasiskv.disagg.decode_side import RemoteSource, admit, fail_requests
from oasiskv.disagg.full_transfer import FullTransfer, plan_reads
from oasiskv.disagg.leases import LeaseTable
from oasiskv.disagg.local_items import LocalItems
from oasiskv.disagg.prefill_side import hand_over
from oasiskv.disagg.remote_reads import RemoteReads
from oasiskv.disagg.socket_transport import SocketTransport
from oasiskv.disagg.transport import TransportError

pytestmark = pytest.mark.slow

PROMPT_TOKENS, TOP_K, NEW_TOKENS = 4000, 32, 8
CONFIG = dict(max_model_len=4200, sparse=True, top_k_blocks=TOP_K, sparse_threshold=2048, host_kv_gb=0.5)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
TWO_TOKENS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def prefill():
    """The prefill engine's hand-over of one request, both admissions, its host pool served,
    and the tokens it decodes itself (colocated) after the hand-over."""
    llm = LLM(**CONFIG)
    engine, sparse = llm.engine, llm.engine.runner.sparse
    ids = llm.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)[:PROMPT_TOKENS]
    rid = engine.add_request(ids, GREEDY)
    seq = engine.seqs[rid]
    while seq.sparse is None:
        engine.step()
    extent = seq.host_extent
    full = full_admission(rid, seq, sparse)
    leases = LeaseTable(sparse.host.free)
    rpf = hand_over(sparse, seq, leases, "decode-0")
    while not seq.is_finished:  # colocated: the same request decoded where it was prefilled
        engine.step()
    assert sparse.host.extent(rid) is extent  # finished, and still held for the lease
    owner = SocketTransport()
    owner.register(sparse.host.items)
    owner.serve()
    yield dict(engine=engine, extent=extent, rpf=Admission.from_bytes(rpf.to_bytes()),
               full=Admission.from_bytes(full.to_bytes()),
               owner=owner, colocated=list(seq.output_token_ids))
    owner.close()
    assert leases.release(rid) and leases.reap() == [rid]
    assert sparse.host.bytes_used == 0


@pytest.fixture(scope="module")
def decode():
    return LLM(remote_kv_gb=0.2, **CONFIG).engine  # the arena holds every item of the prompt: 30 x 250 x 3


def decode_side(engine, strict: bool) -> RemoteReads:
    sparse = engine.runner.sparse
    store = LocalItems.over(engine.runner.remote_items)
    reader = SocketTransport()
    reader.register(store.items)
    reads = RemoteReads(reader, store)
    sparse.remote = RemoteSource(reads, sparse.L, strict=strict)
    return reads


def prompt_kv(prefill) -> torch.Tensor:
    """The prompt's KV in the prefill's host extent [L, nb, Hkv, 2, bs, D]: what full moves."""
    nb = -(-PROMPT_TOKENS // prefill["rpf"].block_size)
    return prefill["engine"].runner.sparse.host.extent_items(prefill["extent"])[:, :nb]
def test_rpf_admission_is_a_quarter_of_full_or_less(prefill):
    rpf, full = prefill["rpf"], prefill["full"]
    kv = prompt_kv(prefill)
    assert rpf.tensors["kmin"].shape[1] == kv.shape[1] == full.num_blocks
    kv_bytes = kv.numel() * kv.element_size()  # full: the admission, then these over the transport
    assert full.tensor_bytes() < kv_bytes / 1000  # the working set's choice: a few KiB
    ratio = rpf.tensor_bytes() / kv_bytes
    wire = len(rpf.to_bytes()) / (len(full.to_bytes()) + kv_bytes)
    print(f"admission bytes: rpf {rpf.tensor_bytes()} full {full.tensor_bytes()} + {kv_bytes} read "
          f"ratio {ratio:.3f} (wire {wire:.3f})")
    assert ratio <= 0.25 and wire <= 0.25
    assert (full.remote_start, full.remote_stride) == (rpf.remote_start, rpf.remote_stride)
    # The working set's KV (read from the GPU slots) equals the host copy of its blocks.
    blocks = rpf.tensors["blocks"]
    layer, head, pos = held_positions(blocks)
    block = blocks[layer, head, pos].long()
    assert torch.equal(rpf.tensors["items"], kv[layer, block, head])
    assert rpf.first_token == prefill["colocated"][0] and rpf.num_cached == PROMPT_TOKENS
    assert full.mode == "full" and full.first_token == rpf.first_token and full.draft == rpf.draft


def test_every_block_read_once_byte_for_byte(prefill, decode):
    """Placed, then every other complete block asked for: one read, each item once, and the
    decode side holds the prefill's bytes."""
    reads = decode_side(decode, strict=True)
    rpf, extent = prefill["rpf"], prefill["extent"]
    try:
        peer = reads.transport.add_peer(prefill["owner"].metadata())
        state = admit_rpf(rpf, reads, peer, extent.max_blocks)
        placed = reads.store.bytes_used
        assert placed == rpf.tensors["items"].numel() * rpf.tensors["items"].element_size()
        L, _, H = state.remote.where.shape
        complete = PROMPT_TOKENS // rpf.block_size
        for layer in range(L):
            reads.want(state.remote, layer, np.arange(extent.max_blocks)[:, None], np.arange(H)[None, :])
        reads.flush()
        reads.wait()
        assert reads.totals.reads == 1
        assert (state.remote.where[:, :complete] >= 0).all()
        assert reads.totals.bytes_read == reads.store.bytes_used - placed  # the placed were not read
        host = prefill["engine"].runner.sparse.host
        src = host.extent_items(extent)[:, :complete]
        where = torch.from_numpy(state.remote.where[:, :complete].reshape(-1))
        assert torch.equal(reads.store.items[where].view(src.shape), src)
    finally:
        reads.release(state.remote)
        reads.poll()
        reads.transport.close()
        assert reads.store.bytes_used == 0


def run_decode(engine, adm: Admission, owner: SocketTransport, strict: bool):
    reads = decode_side(engine, strict)
    peer = reads.transport.add_peer(owner.metadata())
    admit(engine, adm, peer, GREEDY)
    out, peak = None, 0
    while out is None:
        for o in engine.step():
            out = o if o.finished else out
        peak = max(peak, reads.store.bytes_used)
    reads.poll()
    reads.transport.close()
    assert reads.store.bytes_used == 0, "the decode side's host items must all be back"
    return out, reads.totals, peak
def test_strict_rpf_equals_colocated_sparse_decode(prefill, decode):
    adm, kv = prefill["rpf"], prompt_kv(prefill)
    full_bytes = kv.numel() * kv.element_size()
    out, totals, peak = run_decode(decode, adm, prefill["owner"], strict=True)
    assert out.token_ids == prefill["colocated"]
    assert totals.bytes_read > 0  # the working set moved: blocks were read remotely
    print(f"strict: admission {adm.tensor_bytes()} B (full {full_bytes} B), {totals.reads} reads "
          f"({totals.bytes_read} B, {totals.extents} extents), decode-side host peak {peak} B")
    assert peak < full_bytes


def test_full_transfer_equals_colocated_and_reads_nothing_later(prefill, decode):
    """The baseline on the same code: the whole KV read at admission, no remote read after, the
    same tokens."""
    adm = prefill["full"]
    adm.request_id = "full"
    out, totals, peak = run_decode(decode, adm, prefill["owner"], strict=False)
    assert out.token_ids == prefill["colocated"]
    assert totals.reads == 0
    kv = prompt_kv(prefill)
    print(f"full: admission {adm.tensor_bytes()} B, decode-side host peak {peak} B")
    assert peak >= kv.numel() * kv.element_size()


def test_full_read_plan_covers_every_item_once_under_the_cap():
    """Scattered local items, runs of every length: each (remote, local) pair in exactly one
    read, merged extents, no read over the cap."""
    rng = np.random.default_rng(0)
    remote = np.arange(5000) + 100
    local = np.concatenate([np.arange(n) + start for n, start in
                            zip(rng.integers(1, 300, 40), rng.choice(10**6, 40, replace=False) * 300)])[:5000]
    for cap in (1, 7, 64, 1000, 10**6):
        reads = plan_reads(remote, local, cap)
        assert all(ext[:, 2].sum() <= cap for ext in reads)
        got_r = np.concatenate([np.arange(c) + r for ext in reads for r, _, c in ext])
        got_l = np.concatenate([np.arange(c) + l for ext in reads for _, l, c in ext])
        assert np.array_equal(np.sort(got_r), remote)  # every item once
        assert np.array_equal(got_l[np.argsort(got_r)], local)  # into its own local item
        assert len(reads) >= -(-len(remote) // cap) and (cap < len(remote) or len(reads) == 1)


def test_full_transfer_reads_byte_for_byte_in_capped_reads(prefill, decode):
    reads = decode_side(decode, strict=False)
    full, kv = prefill["full"], prompt_kv(prefill)
    transfer = None
    try:
        peer = reads.transport.add_peer(prefill["owner"].metadata())
        cap = 1 << 20
        transfer = FullTransfer.start(reads, full, peer, prefill["extent"].max_blocks, max_read_bytes=cap)
        transfer.wait()
        nbytes = kv.numel() * kv.element_size()
        assert transfer.bytes_read == nbytes == reads.store.bytes_used
        L = kv.shape[0]  # a layer's blocks are one run in the peer's extent: at most one short read each
        assert -(-nbytes // cap) <= len(transfer.plan) <= -(-nbytes // cap) + L and reads.totals.reads == 0
        assert all(ext[:, 2].sum() * reads.store.item_bytes <= cap for ext in transfer.plan)
        where = torch.from_numpy(transfer.remote.where[:, :full.num_blocks].reshape(-1))
        assert torch.equal(reads.store.items[where].view(kv.shape), kv)
        assert transfer.remote.remote_blocks == 0  # nothing is ever read again
    finally:
        if transfer is not None:
            transfer.abandon()
        reads.transport.close()
    assert reads.store.bytes_used == 0


def test_a_peer_dying_during_a_full_transfer_fails_it_only(prefill, decode):
    """The peer closes after the first reads: the transfer fails with a transport error within
    seconds and gives its items back; a transfer from another peer completes."""
    reads = decode_side(decode, strict=False)
    doomed = SocketTransport()
    doomed.register(prefill["engine"].runner.sparse.host.items)
    doomed.serve()
    full, max_blocks = prefill["full"], prefill["extent"].max_blocks
    dies = FullTransfer.start(reads, full, reads.transport.add_peer(doomed.metadata()), max_blocks, 64 << 10)
    dies.advance()
    doomed.close()
    t0 = time.monotonic()
    with pytest.raises(TransportError):
        dies.wait()
    assert time.monotonic() - t0 < 5 and dies.remote.released and reads.store.bytes_used == 0
    lives = FullTransfer.start(reads, full, reads.transport.add_peer(prefill["owner"].metadata()), max_blocks,
                               64 << 10)
    lives.wait()
    kv = prompt_kv(prefill)
    assert reads.store.bytes_used == lives.bytes_read == kv.numel() * kv.element_size()
    lives.abandon()
    reads.transport.close()
    assert reads.store.bytes_used == 0


def test_lazy_reads_and_a_prefill_peer_that_dies(prefill, decode):
    """Two requests, each read from its own peer (two servers of the prefill's host pool): reads
    arrive a step later, one per peer per step. The first peer dies after two steps: its
    request ends with an error within seconds, the other decodes to the end."""
    adm, kv = prefill["rpf"], prompt_kv(prefill)
    doomed = SocketTransport()
    doomed.register(prefill["engine"].runner.sparse.host.items)
    doomed.serve()
    reads = decode_side(decode, strict=False)
    seqs = {}
    for rid, owner in (("dies", doomed), ("lives", prefill["owner"])):
        adm.request_id = rid
        seqs[rid] = admit(decode, adm, reads.transport.add_peer(owner.metadata()), GREEDY)
    outs, peak, steps = {}, 0, 0
    while len(outs) < 2:
        if steps == 2:
            doomed.close()
            killed = time.monotonic()
        for o in decode.step() + fail_requests(decode, reads):
            if o.finished:
                outs[o.request_id] = o
                if o.request_id == "dies":
                    failed_after, failed_steps = time.monotonic() - killed, steps + 1 - 2
        steps += 1
        peak = max(peak, reads.store.bytes_used)
    reads.wait()  # the last step's reads: their items go back as they settle
    reads.transport.close()
    assert outs["dies"].finish_reason == "error" and "prefill" in outs["dies"].error
    # The read posted at the end of the first step after the kill fails at once and is seen in
    # the next step: on an idle host a step here takes about a second; the transport's own
    # bound (5 s) is checked in test_disagg_transport.py.
    assert failed_steps <= 2
    assert outs["lives"].finish_reason == "length" and len(outs["lives"].token_ids) == NEW_TOKENS
    assert 0 < reads.totals.reads <= 2 * (NEW_TOKENS - 1)  # at most one read per peer per step
    assert reads.store.bytes_used == 0, "the decode side's host items must all be back"
    print(f"lazy: {reads.totals.reads} reads over {NEW_TOKENS - 1} steps ({reads.totals.bytes_read} B), "
          f"decode-side host peak {peak} B for two requests (full {kv.numel() * kv.element_size()} B each); "
          f"the dead peer's request failed {failed_steps} steps ({failed_after:.2f} s) after")


class Leases:
    """The decode engine's lease heartbeats, recorded (no prefill server runs here)."""

    def __init__(self):
        self.holding: set[str] = set()

    def hold(self, url, request_id, ttl_s):
        self.holding.add(url)

    def release(self, url, request_id):
        self.holding.discard(url)

    def lost(self):
        return []

    def held(self):
        return len(self.holding)

    def close(self):
        pass


def test_the_lease_is_renewed_from_the_fetch_not_from_the_engine_thread(prefill):
    """Heartbeats start when the HTTP side hands the fetched admission over, before the engine
    thread adds the request: a busy engine cannot let the lease lapse. A discarded one stops."""
    engine = DecodeEngine(EngineConfig.from_flat(**CONFIG), SocketTransport(), remote_kv_gb=0.4)
    engine.heartbeats.close()
    engine.heartbeats = Leases()
    try:
        engine.expect_admission("r", Admission.from_bytes(prefill["full"].to_bytes()), "http://p", 10)
        assert engine.heartbeats.holding == {"http://p"}
        engine.discard_admission("r")
        assert engine.heartbeats.holding == set()
    finally:
        engine.close()


def test_decode_engine_fails_only_the_full_admission_whose_peer_dies(prefill):
    """The decode role's engine admits two full admissions, each from its own peer (prefill url:
    its name here); the first
    peer dies after the first reads: that request ends with an error output, the other decodes
    the colocated tokens, the leases are released and the arena drains."""
    engine = DecodeEngine(EngineConfig.from_flat(**CONFIG), SocketTransport(), remote_kv_gb=0.4, max_read_bytes=4 << 20)
    engine.heartbeats.close()
    engine.heartbeats = Leases()
    doomed = SocketTransport()
    doomed.register(prefill["engine"].runner.sparse.host.items)
    doomed.serve()
    try:
        for rid, owner in (("dies", doomed), ("lives", prefill["owner"])):
            adm = Admission.from_bytes(prefill["full"].to_bytes())
            adm.peer_metadata = owner.metadata().decode()
            engine.expect_admission(rid, adm, f"http://{rid}", 1000)
            engine.add_request(adm.prompt_token_ids, TWO_TOKENS, request_id=rid)
        assert engine.heartbeats.holding == {"http://dies", "http://lives"}  # held while their KV is read
        doomed.close()
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert outs["dies"].finish_reason == "error" and "prefill" in outs["dies"].error
        assert outs["lives"].token_ids == prefill["colocated"][:2]
        kv = prompt_kv(prefill)
        stats = engine.disagg_stats()
        assert stats["admission_transport_bytes"] == kv.numel() * kv.element_size()
        assert stats["admission_bytes"] == 2000 + stats["admission_transport_bytes"] and stats["remote_bytes"] == 0
        assert stats["failed_requests"] == 1
        assert engine.heartbeats.holding == set() and engine.store.bytes_used == 0
    finally:
        engine.close()
