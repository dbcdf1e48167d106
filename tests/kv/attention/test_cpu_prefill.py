"""Prefill chunks split into cached keys and the chunk's own causal square, against the masked reference."""

import pytest
import torch

from kvserve.kv.attention.cpu_prefill import prefill_attention
from kvserve.kv.attention.reference import attend


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("cached,chunk", [(0, 1), (0, 70), (37, 1), (37, 64), (300, 200)])
@pytest.mark.parametrize("window", [None, 50, 1000])
def test_a_chunk_attends_as_the_masked_reference(heads, kv_heads, cached, chunk, window):
    gen = torch.Generator().manual_seed(cached * 7 + chunk)
    q = torch.randn(heads, chunk, 32, generator=gen)
    k = torch.randn(kv_heads, cached + chunk, 32, generator=gen) * 2  # peaked scores: the merge's weights matter
    v = torch.randn(kv_heads, cached + chunk, 32, generator=gen)
    positions = torch.arange(cached, cached + chunk)
    expected = attend(q, k, v, positions, 32**-0.5, window)
    torch.testing.assert_close(prefill_attention(q, k, v, positions, 32**-0.5, window), expected,
                               rtol=1e-5, atol=1e-5)


def test_keys_from_a_windows_first_block():
    # A windowed group reads from its window's first block: keys start past position 0.
    q, k, v = torch.randn(4, 8, 16), torch.randn(2, 40, 16), torch.randn(2, 40, 16)
    positions = torch.arange(132, 140)
    expected = attend(q, k, v, positions, 0.25, 64, key_start=100)
    torch.testing.assert_close(prefill_attention(q, k, v, positions, 0.25, 64, key_start=100), expected)


def test_the_split_runs_where_no_window_cuts_the_keys(monkeypatch):
    from kvserve.kv.attention import cpu_prefill

    calls = []
    flash = cpu_prefill._flash
    monkeypatch.setattr(cpu_prefill, "_flash", lambda *a, **kw: calls.append(a[4]) or flash(*a, **kw))
    q, k, v = torch.randn(4, 8, 16), torch.randn(2, 20, 16), torch.randn(2, 20, 16)
    prefill_attention(q, k, v, torch.arange(12, 20), 0.25)
    assert calls == [True, False]  # the chunk's own square (causal), then the cached keys (unmasked)
    calls.clear()
    prefill_attention(q, k, v, torch.arange(12, 20), 0.25, sliding_window=10)  # the window cuts: masked
    assert calls == []
