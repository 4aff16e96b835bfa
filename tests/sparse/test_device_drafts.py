"""Drafts chosen on the device equal the host's `next_draft`, on random histories: short ones
(fewer tokens than the n-gram), no match, repeats, windows cut by the lookup window."""
import pytest
import torch

from oasiskv.sparse import device_drafts
from oasiskv.sparse.drafters import TokenHistory, ngram_propose, next_draft


def _right_aligned(histories, W):
    h = torch.full((len(histories), W), -1, dtype=torch.long)
    for i, toks in enumerate(histories):
        tail = toks[-W:]
        if tail:
            h[i, W - len(tail):] = torch.tensor(tail)
    return h, torch.tensor([min(len(t), W) for t in histories])


def test_propose_matches_prompt_lookup():
    gen = torch.Generator().manual_seed(0)
    W = 24
    histories = []
    for i in range(400):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        vocab = int(torch.randint(2, 9, (1,), generator=gen))  # small vocabularies repeat n-grams
        histories.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
    histories += [[5], [5, 5], [1, 2, 3], [1, 2, 1, 2]]
    h, lengths = _right_aligned(histories, W)
    proposal, found = device_drafts.propose(h, lengths)
    for i, toks in enumerate(histories):
        want = ngram_propose(toks, window=W)
        assert (found[i].item(), proposal[i].item() if found[i] else None) == (want is not None, want), toks


def test_next_drafts_and_append_follow_the_host_rules():
    gen = torch.Generator().manual_seed(1)
    W, B = 16, 64
    histories = [torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
                 for _ in range(B)]
    h, lengths = _right_aligned(histories, W)
    tokens = torch.randint(0, 4, (B,), generator=gen)
    drafts = torch.where(torch.rand(B, generator=gen) < 0.5, tokens, (tokens + 1) % 4)  # chain held or not
    guesses = torch.randint(0, 4, (B,), generator=gen)
    rows = torch.arange(B)
    device_drafts.append(h, lengths, tokens, rows)
    for drafter in ("self", "ngram", "prev"):
        got = device_drafts.next_drafts(drafter, h, lengths, drafts, tokens, guesses)
        for i, toks in enumerate(histories):
            hist = TokenHistory(toks[-(W - 1):])  # the device window holds the newest W tokens
            hist.append(int(tokens[i]))
            want = next_draft(drafter, hist, int(drafts[i]), int(tokens[i]), int(guesses[i]))
            assert got[i].item() == (int(tokens[i]) if want is None else want), (drafter, toks)


def kernel_matches_torch() -> dict:
    """Runs under Triton's interpreter (a subprocess): `draft_lookup` against the torch rule on
    random histories, windows of 24 (one tile) and 3,000 (three tiles, the last partial)."""
    from oasiskv.kernels.draft_lookup import draft_lookup
    from oasiskv.sparse.drafters import LOOKUP_MAX_N
    gen = torch.Generator().manual_seed(2)
    out = {}
    for W, B in ((24, 48), (3000, 6)):
        histories = [torch.randint(0, int(torch.randint(2, 9, (1,), generator=gen)),
                                   (int(torch.randint(1, W + 40, (1,), generator=gen)),), generator=gen).tolist()
                     for _ in range(B)] + [[5], [5, 5], [1, 2, 3], list(range(W))]
        h, lengths = _right_aligned(histories, W)
        n = len(histories)
        tokens = torch.randint(0, 4, (n,), generator=gen)
        drafts = torch.where(torch.rand(n, generator=gen) < 0.5, tokens, tokens + 1)
        guesses = torch.randint(0, 4, (n,), generator=gen)
        for drafter in ("self", "ngram"):
            want = device_drafts.next_drafts(drafter, h, lengths, drafts, tokens, guesses)
            got = draft_lookup(drafter, h, lengths, drafts, tokens, guesses, LOOKUP_MAX_N)
            out[f"{drafter}_W{W}"] = torch.equal(got, want)
    return out


@pytest.mark.slow
def test_draft_lookup_kernel_matches_torch():
    from triton_interpreter import run_under_interpreter
    assert run_under_interpreter(__file__) == {f"{d}_W{W}": True for W in (24, 3000) for d in ("self", "ngram")}


if __name__ == "__main__":
    import json
    import os
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    print(json.dumps(kernel_matches_torch()))
