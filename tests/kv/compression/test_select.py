"""Kept tokens: the same count per head, sinks and window always kept, deterministic, each method on a case
where the right tokens are obvious."""

import pytest
import torch

from kvserve.kv.compression import CompressionSpec, PromptKV, compress_layer, keep_indices
from kvserve.kv.compression.select import protected_mask

KV_HEADS, HEADS, T, D = 2, 4, 200, 16


def prompt(seed: int = 0, length: int = T, with_queries: bool = True) -> PromptKV:
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(KV_HEADS, length, D, generator=gen), torch.randn(KV_HEADS, length, D, generator=gen)
    queries = torch.randn(HEADS, 32, D, generator=gen) if with_queries else None
    return PromptKV(keys, values, torch.arange(length), queries, D ** -0.5)


@pytest.mark.parametrize("method", ["streaming", "knorm", "keydiff", "expected_attention"])
@pytest.mark.parametrize("ratio", [1, 2, 3.5, 4])
def test_same_count_per_head_sorted_with_sinks_and_window(method, ratio):
    spec = CompressionSpec(method, ratio, sinks=4, window=16)
    kept = compress_layer(prompt(), spec)
    budget = -(-T // ratio) if ratio != 3.5 else 58
    assert kept.indices.shape == (KV_HEADS, int(budget))
    assert kept.keys.shape == kept.values.shape == (KV_HEADS, int(budget), D)
    for head in range(KV_HEADS):
        row = kept.indices[head].tolist()
        assert row == sorted(set(row))
        assert set(range(4)) | set(range(T - 16, T)) <= set(row)
    assert torch.equal(kept.positions, kept.indices)  # positions 0..T-1 here
    gathered = prompt().keys.gather(1, kept.indices[..., None].expand(-1, -1, D))
    assert torch.equal(kept.keys, gathered)


@pytest.mark.parametrize("method", ["streaming", "knorm", "keydiff", "expected_attention"])
def test_deterministic_bit_for_bit(method):
    spec = CompressionSpec(method, 4)
    first, second = compress_layer(prompt(3), spec), compress_layer(prompt(3), spec)
    assert torch.equal(first.indices, second.indices) and torch.equal(first.keys, second.keys)


def test_ties_go_to_the_earlier_token():
    scores = torch.zeros(1, 20)
    kept = keep_indices(scores, CompressionSpec("knorm", 2, sinks=2, window=3))
    assert kept.tolist() == [[0, 1, 2, 3, 4, 5, 6, 17, 18, 19]]


def test_budget_smaller_than_sinks_and_window_keeps_sinks_then_recent():
    assert protected_mask(10, 5, 4, 64).nonzero().flatten().tolist() == [0, 1, 2, 3, 9]
    kept = keep_indices(torch.randn(2, 100), CompressionSpec("keydiff", 10, sinks=4, window=64))
    assert kept.tolist() == [[0, 1, 2, 3, 94, 95, 96, 97, 98, 99]] * 2


def test_non_finite_scores_are_refused():
    with pytest.raises(ValueError, match="finite"):
        keep_indices(torch.tensor([[0.0, float("nan"), 1.0, 2.0]]), CompressionSpec("knorm", 2, 0, 0))


def test_expected_attention_needs_queries():
    with pytest.raises(ValueError, match="last queries"):
        compress_layer(prompt(with_queries=False), CompressionSpec("expected_attention", 2))


def planted(method: str) -> tuple[PromptKV, set[int]]:
    """Random keys with 10 tokens (outside sinks and window) made obviously worth keeping for `method`."""
    kv = prompt(5)
    keys, values = kv.keys.clone(), kv.values.clone()
    special = set(range(50, 150, 10))
    direction = torch.zeros(D)
    direction[0] = 1.0
    for i in special:
        if method == "knorm":
            keys[:, i] *= 0.05  # the lowest norms
        elif method == "expected_attention":
            keys[:, i] = 6 * direction  # what the recent queries look for
    queries = kv.queries
    if method == "expected_attention":
        queries = 0.2 * queries + 3 * direction
    if method == "keydiff":
        keys[:, :, 1] = keys[:, :, 1].abs() + 5  # every key leans one way ...
        for i in special:
            keys[:, i, 1] = -keys[:, i, 1]  # ... these the other
    return PromptKV(keys, values, kv.positions, queries, kv.scale), special


@pytest.mark.parametrize("method", ["knorm", "keydiff", "expected_attention"])
def test_each_method_keeps_the_obvious_tokens(method):
    kv, special = planted(method)
    # Budget 40: sinks 4 + window 16 + 20 chosen; the 10 planted ones must be among them in every head.
    kept = compress_layer(kv, CompressionSpec(method, 5, sinks=4, window=16))
    for head in range(KV_HEADS):
        assert special <= set(kept.indices[head].tolist()), method


def test_streaming_keeps_sinks_and_the_most_recent():
    kept = compress_layer(prompt(), CompressionSpec("streaming", 4, sinks=4, window=16))
    assert kept.indices.tolist() == [list(range(4)) + list(range(T - 46, T))] * KV_HEADS


def test_heads_keep_different_tokens():
    kv = prompt(7)
    kept = compress_layer(kv, CompressionSpec("knorm", 4, window=16))
    assert not torch.equal(kept.indices[0], kept.indices[1])
