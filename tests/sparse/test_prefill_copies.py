"""A prompt that converts when its prefill ends has its completed blocks copied to its host
extent chunk by chunk (oasiskv/sparse/prefill_copies.py); the conversion copies the rest."""
import argparse
from types import SimpleNamespace

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.sparse.manager import SparseManager
from oasiskv.sparse.prefill_copies import PrefillHostCopies

L, SLOTS, H, BS, D = 2, 40, 2, 16, 4


class ExtentIsItems:
    """A host pool whose extents are their own item arrays [L, max_blocks, H, 2, bs, D]."""

    def extent_items(self, extent):
        return extent


def prompt_seq(num_tokens: int, pages: list[int]) -> SimpleNamespace:
    return SimpleNamespace(host_extent=torch.zeros(L, len(pages), H, 2, BS, D), sparse=None, pages=pages,
                           num_cached_tokens=0, num_tokens=num_tokens, prefill_blocks_on_host=0,
                           prefill_copied_to=0, streamed=False)


def blocks_of(kv, pages):
    """[L, blocks, H, 2, bs, D]: the K/V of these pages, as an extent holds them."""
    slots = (torch.tensor(pages)[:, None] * H + torch.arange(H)).flatten()
    return kv[:, slots].view(L, len(pages), H, 2, BS, D)


def step(copies, seq, n):
    copies.after_prefill_step([seq], [n], lambda s: True)
    seq.num_cached_tokens += n


def test_chunks_copy_their_completed_blocks_and_a_restart_starts_over():
    kv = torch.randn(L, SLOTS, 2, BS, D)
    copies = PrefillHostCopies(kv, ExtentIsItems(), BS, H)
    seq = prompt_seq(100, [7, 3, 12, 5, 9, 1, 0])
    step(copies, seq, 40)  # tokens 0..39: blocks 0 and 1 complete, block 2 half
    assert (seq.prefill_blocks_on_host, seq.prefill_copied_to) == (2, 40)
    assert torch.equal(seq.host_extent[:, :2], blocks_of(kv, seq.pages[:2]))
    assert not seq.host_extent[:, 2:].any()
    step(copies, seq, 20)  # tokens 40..59: block 2 completes
    assert seq.prefill_blocks_on_host == 3 and torch.equal(seq.host_extent[:, :3], blocks_of(kv, seq.pages[:3]))
    # Preempted: its prompt is computed again from the start, into other pages.
    seq.num_cached_tokens, seq.pages = 0, [2, 4, 6, 8, 10, 11, 13]
    step(copies, seq, 48)
    assert (seq.prefill_blocks_on_host, seq.prefill_copied_to) == (3, 48)
    assert torch.equal(seq.host_extent[:, :3], blocks_of(kv, seq.pages[:3]))
    step(copies, seq, 52)  # the last chunk: left to the conversion
    assert (seq.prefill_blocks_on_host, seq.prefill_copied_to) == (3, 100)
    assert copies.blocks_copied == 6
    assert copies.taken(seq) == 3 and (seq.prefill_blocks_on_host, seq.prefill_copied_to) == (0, 0)


def test_requests_that_do_not_convert_or_hold_no_extent_copy_nothing():
    kv = torch.randn(L, SLOTS, 2, BS, D)
    copies = PrefillHostCopies(kv, ExtentIsItems(), BS, H)
    stays_dense, no_extent = prompt_seq(100, list(range(7))), prompt_seq(100, list(range(7, 14)))
    no_extent.host_extent = None
    copies.after_prefill_step([stays_dense], [64], lambda s: False)
    copies.after_prefill_step([no_extent], [64], lambda s: True)
    assert copies.blocks_copied == 0 and stays_dense.prefill_blocks_on_host == 0
    assert not stays_dense.host_extent.any()


@pytest.mark.slow
def test_chunked_prompt_converts_with_every_block_on_the_host(monkeypatch):
    """The engine on the default model, a 1,100-token prompt in chunks of 256: the chunks before
    the last copy blocks 0-63, the conversion the other 5, and the extent then holds exactly the
    K/V the dense pages held."""
    checked = []
    convert = SparseManager.convert

    def checking_convert(self, seq, last_q, pages, summary_run):
        nb = -(-seq.num_cached_tokens // self.block_size)
        on_host_before = seq.prefill_blocks_on_host
        slots = (torch.tensor(seq.pages[:nb])[:, None] * self.Hkv + torch.arange(self.Hkv)).flatten()
        want = self.kv[:, slots].reshape(self.L, nb, self.Hkv, *self.kv.shape[2:]).clone()
        convert(self, seq, last_q, pages, summary_run)
        got = self.host.extent_items(seq.host_extent)[:, :nb]
        checked.append((on_host_before, nb, torch.equal(got, want)))

    monkeypatch.setattr(SparseManager, "convert", checking_convert)
    llm = LLM(max_model_len=2048, sparse=True, top_k_blocks=16, sparse_threshold=1024, host_kv_gb=0.5,
              max_num_batched_tokens=256, max_num_seqs=4)
    ids = llm.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)[:1100]
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    assert checked == [(64, 69, True)]
    assert llm.engine.runner.sparse.prefill_copies.blocks_copied == 64
