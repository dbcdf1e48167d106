"""The contiguous context (no cache): one whole sequence over its own K/V, per-layer windows, variants."""

import pytest
import torch

from kvserve.kv.attention import ContiguousContext, attend

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def test_each_layer_attends_with_its_own_window():
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(12)
    context = ContiguousContext(positions, (None, 3))
    q = torch.randn(12, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(12, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(12, KV_HEADS, HEAD_DIM, generator=gen)
    for layer, window in enumerate((None, 3)):
        expected = attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), positions, 0.5, window)
        torch.testing.assert_close(context.attend(layer, q, k, v, 0.5), expected)
    assert not torch.allclose(context.attend(0, q, k, v, 0.5), context.attend(1, q, k, v, 0.5))


def test_only_a_whole_sequence_is_accepted():
    with pytest.raises(ValueError, match="the input must be the whole sequence"):
        ContiguousContext(torch.arange(3, 8), (None,))


def test_a_variant_context_reaches_every_layer_of_the_model(tiny_models):
    # What bench/int4_variants.py relies on: the model uses the context it is given, layer by layer.
    model = tiny_models("llama-gqa").model

    class Recording(ContiguousContext):
        def attend_sequence(self, q, k, v, scale, sliding_window):
            self.calls.append((q.shape, k.shape, sliding_window))
            return super().attend_sequence(q, k, v, scale, sliding_window)

    ids, positions = torch.tensor([5, 9, 2, 7]), torch.arange(4)
    context = Recording(positions, model.layer_windows)
    context.calls = []
    torch.testing.assert_close(model(ids, positions, context), model(ids, positions))
    assert len(context.calls) == model.config.num_layers
    assert context.calls[0][0] == (model.config.num_heads, 4, model.config.head_dim)
