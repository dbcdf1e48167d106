"""Layers of different K/V shapes in one paged pool (kv/cache/packing.py, kv/attention/cpu_packed.py): two
windowed layers of two 8-wide KV heads (plain: a slot holds one), a full K = V layer of one 16-wide head
(packed into one slot, half of it padding), a full layer of two 16-wide heads (spanning two slots), and three
layers that read those caches. Paged attention equals the contiguous context's, and a packed layer's rows
are the same bits however the sequence is chunked."""

import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.kv.attention import ContiguousContext
from kvserve.kv.attention.base import SequenceSlice
from kvserve.kv.attention.cpu import CpuAttentionBackend, TorchCpuAttentionBackend
from kvserve.kv.cache.kv_spec import kv_spec
from kvserve.kv.cache.packing import LayerKV, pack_tokens, row_geometry, slots_needed, unpack_blocks, unpack_tokens

WINDOW, BLOCK, HEADS, TOKENS = 6, 4, 4, 19
SHAPES = ((2, 8), (2, 8), (1, 16), (2, 16), (2, 8), (1, 16), (2, 16))
CONFIG = ModelConfig("test", 32, 32, 32, 7, HEADS, 2, 8, 64, 1e-6, 1e4,
                     layer_windows=(WINDOW, WINDOW, None, None, WINDOW, None, None), layer_kv_shapes=SHAPES,
                     layer_k_eq_v=(False, False, True, False, False, True, False),
                     kv_source_layers=(0, 1, 2, 3, 1, 2, 3))


def keys_from_values(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Any function of (value, position) serves: a scaled value turned by a position-dependent angle."""
    angle = positions.to(values.dtype)[:, None, None] * 0.1
    half = values.shape[-1] // 2
    a, b = values[..., :half] * 1.5, values[..., half:] * 0.5
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=-1)


def layer_inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for layer, (kv_heads, dim) in enumerate(SHAPES):
        q = torch.randn(TOKENS, HEADS, dim, generator=generator)
        k = torch.randn(TOKENS, kv_heads, dim, generator=generator)
        v = torch.randn(TOKENS, kv_heads, dim, generator=generator)
        inputs.append((q, None if CONFIG.k_eq_v_of(layer) else k, v))
    return inputs


def call(context, layer, q, k, v):
    if CONFIG.kv_source_of(layer) != layer:
        return context.attend(layer, q, None, None, 1.0)
    return context.attend(layer, q, k, v, 1.0, keys_from_values=keys_from_values if k is None else None)


def contiguous_outputs():
    context = ContiguousContext(torch.arange(TOKENS), CONFIG.layer_windows, CONFIG.kv_source_layers)
    return [call(context, layer, *x) for layer, x in enumerate(layer_inputs())]


def paged_outputs(backend, chunks, dtype="float32"):
    spec = kv_spec(CONFIG, dtype)
    cache = backend.allocate_kv_cache(spec, 32, BLOCK)
    cache.initialize_blocks_through(31)
    groups = spec.layout.num_groups
    tables = [list(range(5 * group, 5 * group + 5)) for group in range(groups)]  # one table per KV group
    inputs, outputs, start = layer_inputs(), [[] for _ in SHAPES], 0
    for count in chunks:
        context = backend.build_context(cache, [SequenceSlice(tables, start, count)])
        rows = slice(start, start + count)
        for layer, (q, k, v) in enumerate(inputs):
            outputs[layer].append(call(context, layer, q[rows], None if k is None else k[rows], v[rows]))
        start += count
    return [torch.cat(out) for out in outputs]


def test_row_geometry_holds_the_largest_layer_and_packs_k_eq_v_over_both_sides():
    sliding, full = [LayerKV(1, 256)] * 4, LayerKV(1, 512)
    assert row_geometry(sliding + [full]) == (1, 256)  # Gemma 4 E2B: the sliding layers plain, a global spans 2
    assert slots_needed(full, 1, 256) == 2 and slots_needed(LayerKV(1, 512, k_eq_v=True), 1, 256) == 1
    assert row_geometry([LayerKV(16, 256)] * 5 + [LayerKV(4, 512, k_eq_v=True)]) == (16, 256)  # 31B-shaped
    spec = kv_spec(CONFIG, "float32")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (5, 2, 8)
    assert spec.layer_sources == (0, 1, 2, 3, 1, 2, 3) and spec.layer_first_slot == (0, 1, 2, 3)
    assert spec.layer_windows == (WINDOW, WINDOW, None, None, None) and spec.slots_of(3) == range(3, 5)
    assert spec.packed(0) is None and spec.packed(2) == LayerKV(1, 16, True) and spec.packed(3) == LayerKV(2, 16)
    assert spec.padding_bytes_per_token() == 2 * 8 * 4  # the K = V layer fills one row of two per side
    assert "4 stored layers (3 more read another's), 1 of them K = V (V alone) in 5 slots x 2 rows x" in spec.formula()


def test_pack_and_unpack_are_inverse():
    layer = LayerKV(1, 16, k_eq_v=True)
    v = torch.randn(5, 1, 16)
    k_rows, v_rows = pack_tokens(layer, 2, 8, None, v)
    assert k_rows.shape == (5, 2, 8) and not k_rows[:, 1].any()
    assert torch.equal(unpack_tokens(layer, 8, k_rows, v_rows)[1], v)
    blocks = lambda rows: rows.view(1, 5, 2, 8).transpose(1, 2)  # noqa: E731  [NB, rows, bs, W]
    _, v_blocks = unpack_blocks(layer, 8, blocks(k_rows), blocks(v_rows))
    assert torch.equal(v_blocks[0, 0], v[:, 0])


@pytest.mark.parametrize("backend", [CpuAttentionBackend(), TorchCpuAttentionBackend()], ids=["cpp", "torch"])
def test_paged_layers_of_different_shapes_match_the_contiguous_context(backend):
    expected = contiguous_outputs()
    for chunks in ([TOKENS], [7, 5, 1, 1, 5], [1] * TOKENS):
        for layer, (got, want) in enumerate(zip(paged_outputs(backend, chunks), expected)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"layer {layer}, chunks {chunks}")


def test_a_packed_layer_is_the_same_bits_however_chunked():
    whole = paged_outputs(CpuAttentionBackend(), [TOKENS])
    for chunks in ([7, 5, 1, 1, 5], [1] * TOKENS, [16, 3]):
        for layer in (2, 3, 5, 6):  # the packed layers and their readers
            assert torch.equal(paged_outputs(CpuAttentionBackend(), chunks)[layer], whole[layer]), (layer, chunks)


def test_int8_cache_runs_packed_layers_close_to_float():
    expected = contiguous_outputs()
    for got, want in zip(paged_outputs(CpuAttentionBackend(), [7, 5, 7], "int8"), expected):
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.1)


def test_a_reader_before_its_source_is_refused():
    backend = CpuAttentionBackend()
    spec = kv_spec(CONFIG, "float32")
    cache = backend.allocate_kv_cache(spec, 16, BLOCK)
    context = backend.build_context(cache, [SequenceSlice([[group] for group in range(spec.layout.num_groups)], 0, 2)])
    with pytest.raises(ValueError, match="has not written"):
        context.attend(4, torch.randn(2, HEADS, 8), None, None, 1.0)


SHARING = ModelConfig("test", 32, 32, 32, 8, HEADS, 2, 8, 64, 1e-6, 1e4,
                      layer_windows=(WINDOW, None, None, WINDOW, None, WINDOW, WINDOW, None),
                      layer_kv_shapes=((2, 8), (1, 8), (1, 8), (2, 8), (1, 8), (2, 8), (2, 8), (1, 8)),
                      layer_k_eq_v=(False, True, True, False, False, False, False, True),
                      kv_source_layers=(0, 1, 2, 3, 4, 5, 6, 2))


def test_small_layers_of_one_window_share_a_slot():
    """Three full layers of one 8-wide head (two K = V: one row on the K side each) beside windowed layers of
    two heads (a slot's two rows: plain): the K = V pair shares a slot, the third takes another; a blockwise
    codec (int4 keys) gives each its own."""
    spec = kv_spec(SHARING, "float32")
    assert (spec.num_kv_heads, spec.head_dim) == (2, 8)
    assert spec.layer_first_slot == (0, 1, 1, 2, 3, 4, 5) and spec.layer_row_offset == (0, 0, 1, 0, 0, 0, 0)
    assert spec.layer_windows == (WINDOW, None, WINDOW, None, WINDOW, WINDOW)
    assert spec.padding_bytes_per_token() == 4 * 8 * 4  # the K = V pair's two V-side rows, the third's other row
    assert [(list(slots), layers) for slots, layers in spec.slot_units()] == [
        ([0], [0]), ([1], [1, 2]), ([2], [3]), ([3], [4]), ([4], [5]), ([5], [6])]
    assert [spec.packed(layer) is None for layer in range(7)] == [True, False, False, True, False, True, True]
    assert kv_spec(SHARING, "int4").layer_first_slot == (0, 1, 2, 3, 4, 5, 6)  # int4 keys: blockwise


@pytest.mark.parametrize("backend", [CpuAttentionBackend(), TorchCpuAttentionBackend()], ids=["cpp", "torch"])
def test_layers_sharing_a_slot_match_the_contiguous_context(backend):
    generator = torch.Generator().manual_seed(3)
    inputs = []
    for layer in range(8):
        kv_heads, dim = SHARING.kv_shape_of(layer)
        q, k, v = (torch.randn(TOKENS, n, dim, generator=generator) for n in (HEADS, kv_heads, kv_heads))
        inputs.append((q, None if SHARING.k_eq_v_of(layer) else k, v))

    def call_sharing(context, layer, q, k, v):
        if SHARING.kv_source_of(layer) != layer:
            return context.attend(layer, q, None, None, 1.0)
        return context.attend(layer, q, k, v, 1.0, keys_from_values=keys_from_values if k is None else None)

    reference = ContiguousContext(torch.arange(TOKENS), SHARING.layer_windows, SHARING.kv_source_layers)
    expected = [call_sharing(reference, layer, *x) for layer, x in enumerate(inputs)]
    spec = kv_spec(SHARING, "float32")
    cache = backend.allocate_kv_cache(spec, 32, BLOCK)
    cache.initialize_blocks_through(31)
    tables = [list(range(5 * group, 5 * group + 5)) for group in range(spec.layout.num_groups)]
    outputs, start = [[] for _ in inputs], 0
    for count in (7, 5, 1, 6):
        context = backend.build_context(cache, [SequenceSlice(tables, start, count)])
        for layer, (q, k, v) in enumerate(inputs):
            rows = slice(start, start + count)
            outputs[layer].append(call_sharing(context, layer, q[rows], None if k is None else k[rows], v[rows]))
        start += count
    for layer, (got, want) in enumerate(zip(outputs, expected)):
        torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-5, msg=f"layer {layer}")
