"""Per-layer attention kinds: a layer whose window differs from its neighbours attends with its own, on decode too."""

import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.kv.attention import SequenceSlice, attend
from kvserve.kv.attention.cpu import TorchCpuAttentionBackend
from kvserve.kv.cache.kv_spec import KVSpec
from kvserve.model.loader import load_model
from tests.kv.attention.test_cpu import seen
from tests.helpers import TINY_VOCAB, build_hf_model, paged_logits, save_hf_model, write_tokens

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 8, 4
LAYER_WINDOWS = (None, 5, None)
SCALE = HEAD_DIM**-0.5
# The torch kernels (split-KV, union), whose per-layer windows these tests check; the C++ kernel's
# windows are checked in test_cpu_kernels.py.
CPU = TorchCpuAttentionBackend()


def run_layers(cache_dtype: str, tables: list[list[int]], lengths: list[tuple[int, int]], layer_windows=LAYER_WINDOWS):
    """Requests with block `tables` and (tokens cached, tokens new) `lengths`: every layer's output and reference.

    Each KV group gets the tables shifted into its own 40 blocks of the pool."""
    gen = torch.Generator().manual_seed(0)
    spec = KVSpec(len(layer_windows), KV_HEADS, HEAD_DIM, cache_dtype, layer_windows)
    layout = spec.layout
    cache = CPU.allocate_kv_cache(spec, num_blocks=40 * layout.num_groups, block_size=BLOCK)
    cache.initialize_blocks_through(40 * layout.num_groups - 1)
    group_tables = [[[block + 40 * group for block in table] for group in range(layout.num_groups)] for table in tables]
    full_k, full_v = [], []  # [layer][request]
    for layer in range(len(layer_windows)):
        ks = [torch.randn(c + n, KV_HEADS, HEAD_DIM, generator=gen) for c, n in lengths]
        vs = [torch.randn(c + n, KV_HEADS, HEAD_DIM, generator=gen) for c, n in lengths]
        # Shared blocks hold the same keys for every request that lists them.
        for i in range(1, len(tables)):
            shared = 0
            while shared < min(len(tables[0]), len(tables[i])) and tables[i][shared] == tables[0][shared]:
                shared += 1
            ks[i][: shared * BLOCK] = ks[0][: shared * BLOCK]
            vs[i][: shared * BLOCK] = vs[0][: shared * BLOCK]
        for by_group, (cached, _), k, v in zip(group_tables, lengths, ks, vs):
            if cached:
                write_tokens(cache, layer, by_group[layout.layer_group[layer]], 0, k[:cached], v[:cached])
        full_k.append(ks)
        full_v.append(vs)
    slices = [SequenceSlice(by_group, c, n) for by_group, (c, n) in zip(group_tables, lengths)]
    context = CPU.build_context(cache, slices)
    num_tokens = sum(n for _, n in lengths)
    outputs, expected = [], []
    for layer, window in enumerate(layer_windows):
        q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)
        new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k[layer], lengths)])
        new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v[layer], lengths)])
        outputs.append(context.attend(layer, q, new_k, new_v, SCALE))
        row, reference = 0, []
        for (cached, new), k, v in zip(lengths, full_k[layer], full_v[layer]):
            for position in range(cached, cached + new):  # each query over the K/V it reads
                sk, sv = seen(cache, k, v, position)
                reference.append(attend(q[row : row + 1].transpose(0, 1), sk.transpose(0, 1), sv.transpose(0, 1),
                                        torch.tensor([position]), SCALE, window))
                row += 1
        expected.append(torch.cat(reference))
    return context, outputs, expected


@pytest.mark.parametrize("cache_dtype", ["float32", "int8", "int4"])
def test_split_kv_decode_uses_each_layers_window(cache_dtype):
    # Six decodes in private blocks (split-KV: no sharing) and a prefill chunk; positions reach past the window.
    lengths = [(13, 1), (9, 1), (6, 1), (15, 1), (4, 1), (11, 1), (10, 4)]
    free = torch.randperm(40, generator=torch.Generator().manual_seed(2)).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // BLOCK))] for c, n in lengths]
    context, outputs, expected = run_layers(cache_dtype, tables, lengths)
    assert all(m.decode.union_block_ids is None for m in context.group_metadata)  # the split-KV path
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # The windowed layer reads fewer blocks, so the window decides its result.
    full, windowed = (context.group_metadata[context.layer_group[layer]] for layer in (0, 1))
    assert windowed.decode.block_ids.numel() < full.decode.block_ids.numel()


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_union_decode_uses_each_layers_window(cache_dtype):
    # Six decodes sharing a 16-token prefix (the union path), each with a private last block.
    shared = [5, 9, 2, 30]
    tables = [shared + [11 + i] for i in range(6)]
    lengths = [(16 + own - 1, 1) for own in [1, 2, 3, 4, 2, 1]]
    context, outputs, expected = run_layers(cache_dtype, tables, lengths)
    assert context.group_metadata[0].decode.union_block_ids is not None
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_metadata_is_built_once_per_kv_group():
    # Layers 0 and 2 (full) form one group, 1 and 3 (window 5) the other: two metadata, each group's own blocks.
    spec = KVSpec(4, KV_HEADS, HEAD_DIM, "float32", (None, 5, None, 5))
    context = CPU.build_context(CPU.allocate_kv_cache(spec, 16, BLOCK),
                                [SequenceSlice(([0, 1, 2], [8, 9, 10]), 9, 1), SequenceSlice(([3, 4], [11, 12]), 0, 6)])
    assert context.layer_group == (0, 1, 0, 1)
    full, windowed = context.group_metadata
    assert (full.sliding_window, windowed.sliding_window) == (None, 5)
    assert full.slot_blocks.tolist() == [2] + [3] * 4 + [4, 4] and windowed.slot_blocks.tolist() == [10] + [11] * 4 + [12, 12]
    # The windowed decode at position 9 reads from position 5 on: blocks 1 and 2 of its table, not block 0.
    assert full.decode.block_ids.tolist() == [0, 1, 2] and windowed.decode.block_ids.tolist() == [9, 10]


def test_a_model_layer_with_its_own_window_decodes_like_the_recompute(tmp_path):
    # The middle layer of a 3-layer model gets a 5-token window; its neighbours attend to everything.
    model = load_model(save_hf_model(build_hf_model("llama-gqa"), tmp_path)).model
    token_ids = torch.randint(0, TINY_VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    full = paged_logits(model, token_ids, [8])
    model.layers[1].self_attn.sliding_window = 5
    assert model.layer_windows == (None, 5, None)
    cached = paged_logits(model, token_ids, [8])  # one prefill, then 16 decode steps through the cache
    recomputed = model(torch.tensor(token_ids), torch.arange(len(token_ids)))  # the contiguous context
    assert (cached - recomputed).abs().max().item() <= 1e-4
    assert torch.allclose(cached[:5], full[:5], atol=1e-5)  # inside the window nothing changes
    assert not torch.allclose(cached[-1], full[-1], atol=1e-3)  # past it the window is applied


def test_model_config_gives_each_layer_its_window():
    base = dict(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=3,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
                rope_theta=10000.0)
    assert [ModelConfig(**base, sliding_window=8).window_for_layer(i) for i in range(3)] == [8, 8, 8]
    mixed = ModelConfig(**base, sliding_window=8, layer_windows=(4, 4, None))
    assert [mixed.window_for_layer(i) for i in range(3)] == [4, 4, None]
    with pytest.raises(ValueError, match="layer_windows has 2 entries for 3 layers"):
        ModelConfig(**base, layer_windows=(4, None))
    with pytest.raises(ValueError, match="positive token count or None, got 0"):
        ModelConfig(**base, layer_windows=(4, 0, None))
