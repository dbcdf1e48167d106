"""Prompt lookup: the longest earlier occurrence of the request's suffix, and what followed it."""

import numpy as np

from kvserve.engine.spec_decode.ngram import NgramProposer, find_continuation


def test_the_longest_matching_suffix_wins_and_its_continuation_is_drafted():
    # The suffix [7, 8, 9] occurred at 0 (followed by 1, 2) and [8, 9] also at 10 (followed by 5).
    tokens = [7, 8, 9, 1, 2, 3, 4, 0, 0, 0, 8, 9, 5, 6, 7, 8, 9]
    assert find_continuation(tokens, 4, min_n=2, max_n=3) == (3, [1, 2, 3, 4])
    # With max_n 2 the most recent occurrence of [8, 9] wins.
    assert find_continuation(tokens, 4, min_n=2, max_n=2) == (2, [5, 6, 7, 8])


def test_no_match_shorter_than_min_n_drafts_nothing():
    assert find_continuation([1, 2, 3, 4, 5, 3], 4, min_n=2, max_n=4) == (0, [])
    assert find_continuation([1, 2, 3, 4, 5, 3], 4, min_n=1, max_n=4) == (1, [4, 5, 3])
    assert find_continuation([1], 4, min_n=1, max_n=4) == (0, [])


def test_a_copy_is_drafted_up_to_max_tokens():
    source = list(range(100, 160))
    proposer = NgramProposer(min_n=2, max_n=5)
    # The output has started copying the source: the rest of it is drafted.
    assert proposer.propose("r", source + [0] + source[:10], 8) == source[10:18]
    assert proposer.propose("r", source + [0] + source[:10], 0) == []


def test_the_incremental_index_agrees_with_the_scan():
    rng = np.random.default_rng(0)
    proposer = NgramProposer(min_n=2, max_n=5)
    tokens = rng.integers(0, 12, 20).tolist()  # a small vocabulary: many partial matches
    for _ in range(300):
        assert proposer.lookup("r", tokens, 4) == find_continuation(tokens, 4, min_n=2, max_n=5)
        tokens.append(int(rng.integers(0, 12)))
    del tokens[10:60]  # a context shift rewrites the tokens: the index is rebuilt
    assert proposer.lookup("r", tokens, 4) == find_continuation(tokens, 4, min_n=2, max_n=5)
