"""Prompt lookup (the n-gram drafter and the `self` chain's fallback) against a plain loop."""
from hypothesis import given, settings, strategies as st

from oasiskv.sparse.drafters import TokenHistory, ngram_propose


def plain_lookup(tokens, max_n=3, window=4096):
    hist = tokens[-window:]
    for n in range(min(max_n, len(hist) - 1), 0, -1):
        for i in range(len(hist) - n - 1, -1, -1):  # latest occurrence first
            if hist[i:i + n] == hist[-n:]:
                return hist[i + n]
    return None


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=60), st.sampled_from([4096, 5, 17]), st.integers(0, 60))
def test_lookup_matches_plain_loop(tokens, window, split):
    want = plain_lookup(tokens, window=window)
    assert ngram_propose(tokens, window=window) == want
    history = TokenHistory(tokens[:split])  # built, then grown token by token, as the engine does
    for t in tokens[split:]:
        history.append(t)
    assert ngram_propose(history, window=window) == want


def test_lookup_prefers_the_longest_latest_match():
    tokens = [7, 1, 2, 9, 5, 1, 2, 8, 0, 1, 2]
    assert ngram_propose(tokens) == 8  # "1 2" last seen before "8"; token 0 is a valid answer too
    assert ngram_propose([3, 0, 3]) == 0
