"""Attention over a compressed prefix: nothing dropped equals uncompressed attention bit for bit; per-head kept
tokens and windows against an explicit loop; a model's continuation over its own uncompressed prefix."""

import pytest
import torch

from kvserve.kv.attention import attend
from kvserve.kv.attention.reference import masked_attention, with_sinks
from kvserve.kv.compression import (CompressedPrefixContext, CompressionSpec, PromptCapture, PromptKV,
                                    attend_kept, compress_layer)

HEADS, KV_HEADS, D, P, N = 4, 2, 8, 40, 6


def tensors(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(HEADS, N, D, generator=gen)
    k, v = torch.randn(KV_HEADS, P + N, D, generator=gen), torch.randn(KV_HEADS, P + N, D, generator=gen)
    return q, k, v


def prefix_of(k, v, spec):
    return compress_layer(PromptKV(k[:, :P], v[:, :P], torch.arange(P)), spec)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_ratio_one_is_uncompressed_attention_bit_for_bit(with_sinks):
    q, k, v = tensors()
    sinks = torch.randn(HEADS) if with_sinks else None
    prefix = prefix_of(k, v, CompressionSpec("keydiff", 1))
    got = attend_kept(q, torch.arange(P, P + N), prefix, k[:, P:], v[:, P:], 0.3, sinks=sinks)
    expected = attend(q, k, v, torch.arange(P, P + N), 0.3, sinks=sinks)
    assert torch.equal(got, expected)


def loop_reference(q, q_positions, prefix, k, v, scale, window=None):
    """Each query head over its KV head's kept tokens and the new ones, one softmax at a time."""
    out = torch.empty(HEADS, N, D)
    group = HEADS // KV_HEADS
    for h in range(HEADS):
        kh = h // group
        keys, values = torch.cat([prefix.keys[kh], k[kh]]), torch.cat([prefix.values[kh], v[kh]])
        key_positions = torch.cat([prefix.positions[kh], q_positions])
        for i, p in enumerate(q_positions.tolist()):
            allowed = (key_positions <= p) & (True if window is None else (p - key_positions < window))
            scores = (keys[allowed] @ q[h, i]) * scale
            out[h, i] = scores.softmax(-1) @ values[allowed]
    return out.transpose(0, 1).reshape(N, -1)


@pytest.mark.parametrize("window", [None, 10, 30])
def test_per_head_kept_tokens_and_windows_against_a_loop(window):
    q, k, v = tensors(1)
    prefix = prefix_of(k, v, CompressionSpec("knorm", 3, sinks=2, window=4))
    assert not torch.equal(prefix.indices[0], prefix.indices[1])
    positions = torch.arange(P, P + N)
    got = attend_kept(q, positions, prefix, k[:, P:], v[:, P:], 0.4, sliding_window=window)
    torch.testing.assert_close(got, loop_reference(q, positions, prefix, k[:, P:], v[:, P:], 0.4, window),
                               atol=1e-6, rtol=1e-5)


def test_sinks_with_per_head_masks_match_the_explicit_softmax():
    q, k, v = tensors(2)
    prefix = prefix_of(k, v, CompressionSpec("knorm", 3, sinks=2, window=4))
    sinks, positions = torch.randn(HEADS), torch.arange(P, P + N)
    got = attend_kept(q, positions, prefix, k[:, P:], v[:, P:], 0.4, sliding_window=10, sinks=sinks)
    keys = torch.cat([prefix.keys, k[:, P:]], 1)
    values = torch.cat([prefix.values, v[:, P:]], 1)
    key_positions = torch.cat([prefix.positions, positions.expand(KV_HEADS, -1)], 1)
    distance = positions[None, :, None] - key_positions[:, None, :]
    mask = ((distance >= 0) & (distance < 10))[:, None]
    out, lse = masked_attention(q, keys, values, mask, 0.4)
    torch.testing.assert_close(got, with_sinks(out, lse, sinks).transpose(0, 1).reshape(N, -1))


@pytest.mark.parametrize("variant", ["llama-gqa", "gemma3"])
def test_a_continuation_over_its_whole_prefix_matches_one_forward(tiny_models, variant):
    # Not bit for bit: the continuation's projections run on 6 rows instead of 30, and a GEMM's summation
    # order may differ with the row count; attention itself is the same SDPA call (the test above).
    model = tiny_models(variant).model
    ids = torch.randint(0, 100, (30,), generator=torch.Generator().manual_seed(0))
    split = 24
    full = model(ids, torch.arange(30))
    capture = PromptCapture(torch.arange(split), model.layer_windows)
    model(ids[:split], torch.arange(split), capture)
    spec = CompressionSpec("expected_attention", 1)
    prefixes = [compress_layer(kv, spec) for kv in capture.layers()]
    context = CompressedPrefixContext(torch.arange(split, 30), prefixes, model.layer_windows)
    continued = model(ids[split:], torch.arange(split, 30), context)
    torch.testing.assert_close(continued, full[split:], atol=1e-6, rtol=1e-5)
    # Compressed, the continuation still runs and differs.
    prefixes = [compress_layer(kv, CompressionSpec("expected_attention", 2, sinks=2, window=4))
                for kv in capture.layers()]
    context = CompressedPrefixContext(torch.arange(split, 30), prefixes, model.layer_windows)
    assert not torch.allclose(model(ids[split:], torch.arange(split, 30), context), full[split:])
