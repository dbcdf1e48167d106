"""int4 keys per channel over a block (KIVI) and the float16 open block: error bounds per layout, outlier
channels, and the block's lifecycle (encoded exactly once, when full; a shared block never again)."""

import pytest
import torch

from kvserve.kv.attention.cpu import CpuAttentionBackend, TorchCpuAttentionBackend, slot_indices
from kvserve.kv.cache.quant import CODECS, key_codec
from kvserve.kv.cache.kv_spec import KVSpec

HEADS, BLOCK, DIM = 2, 16, 64


def keys(tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, HEADS, DIM, generator=gen)


def test_key_codecs_by_dtype():
    assert key_codec("int4").blockwise and not CODECS["int4"].blockwise  # values stay per token
    assert not key_codec("int8").blockwise and key_codec("float16") is CODECS["float16"]


def test_per_channel_error_is_half_a_step_of_each_channel_over_the_block():
    codec = key_codec("int4")
    x = keys(4 * BLOCK).view(4, BLOCK, HEADS, DIM).transpose(1, 2)  # [blocks, heads, rows, D]
    data, params = codec.encode_blocks(x)
    assert data.shape == (4, HEADS, BLOCK, DIM // 2) and params.shape == (4, HEADS, BLOCK, 2 * DIM // BLOCK)
    y = codec.decode_blocks(data, params, torch.float32)
    span = x.amax(-2, keepdim=True) - x.amin(-2, keepdim=True)  # per (block, head, channel)
    bound = span / 15 * (0.5 + 16 * 2**-10) + x.abs().amax(-2, keepdim=True) * 2**-10 + 1e-6
    assert ((y - x).abs() <= bound).all()


def test_an_outlier_channel_costs_the_other_channels_nothing():
    codec = key_codec("int4")
    x = keys(BLOCK).transpose(0, 1)[None]  # one block
    outlier = x.clone()
    outlier[..., 5] *= 100  # one channel 100x the rest, across every token (what real keys do)
    plain_err = (codec.decode_blocks(*codec.encode_blocks(x), torch.float32) - x).abs()
    err = (codec.decode_blocks(*codec.encode_blocks(outlier), torch.float32) - outlier).abs()
    others = torch.arange(DIM) != 5
    assert torch.equal(err[..., others], plain_err[..., others])  # their scales never see the outlier
    relative = err / (outlier.amax(-2, keepdim=True) - outlier.amin(-2, keepdim=True))
    assert relative[..., 5].max() <= relative[..., others].max() + 1e-3  # nor does it lose more than they do
    # A per-token layout, by contrast, spreads the outlier's range over its whole group of channels.
    rows = CODECS["int4"]
    token_err = (rows.decode(*rows.encode(outlier), torch.float32) - outlier).abs()
    assert token_err[..., :16][..., others[:16]].mean() > 10 * err[..., :16][..., others[:16]].mean()


@pytest.mark.parametrize("backend", [CpuAttentionBackend, TorchCpuAttentionBackend])
def test_a_block_is_encoded_once_when_its_last_row_is_written(backend):
    spec = KVSpec(2, HEADS, DIM, "int4")
    cache = backend().allocate_kv_cache(spec, num_blocks=8, block_size=BLOCK, max_num_seqs=2)
    cache.initialize_blocks_through(7)
    k, v = keys(2 * BLOCK + 3, 1), keys(2 * BLOCK + 3, 2)
    table = torch.tensor([6, 1, 4])
    encoded = []
    store = cache.store_blocks
    cache.store_blocks = lambda slot, ids, *kv: (encoded.append((slot, ids.tolist())), store(slot, ids, *kv))
    for position in range(k.shape[0]):  # decode-like: one token a step, every layer
        at = torch.tensor([position])
        rows = slot_indices(table[at // BLOCK], at % BLOCK, HEADS, BLOCK)
        for layer in range(2):
            cache.write(layer, rows, k[at], v[at])
        if position % BLOCK == BLOCK - 1:  # the write of the last row encodes it, once, in every layer
            block = int(table[position // BLOCK])
            assert encoded[-2:] == [(0, [block]), (1, [block])]
        full = position // BLOCK * BLOCK + (BLOCK if position % BLOCK == BLOCK - 1 else 0)
        assert len(encoded) == 2 * (full // BLOCK)
    everything = torch.arange(k.shape[0])
    read_k, read_v = cache.read_rows(1, slot_indices(table[everything // BLOCK], everything % BLOCK, HEADS, BLOCK))
    tail = slice(2 * BLOCK, None)  # the open block: float16, exact to its rounding
    assert torch.equal(read_k[tail], k[tail].half().float()) and torch.equal(read_v[tail], v[tail].half().float())
    assert (read_k[: 2 * BLOCK] - k[: 2 * BLOCK]).abs().max() < 0.5  # encoded int4
    assert cache.open_blocks.slot_of[0][4] >= 0 and cache.open_blocks.slot_of[0][6] < 0


def test_a_chunk_of_whole_blocks_goes_straight_to_the_pool_and_gathers_as_it_reads_rows():
    spec = KVSpec(1, HEADS, DIM, "int4")
    cache = TorchCpuAttentionBackend().allocate_kv_cache(spec, num_blocks=8, block_size=BLOCK, max_num_seqs=1)
    cache.initialize_blocks_through(7)
    k, v = keys(40, 3), keys(40, 4)
    table = torch.tensor([3, 5, 2])
    positions = torch.arange(40)
    rows = slot_indices(table[positions // BLOCK], positions % BLOCK, HEADS, BLOCK)
    cache.write(0, rows, k, v)
    assert cache.open_blocks.encodes == 2 and cache.open_blocks.slot_of[0][2] >= 0  # blocks 3, 5 whole; 2 open
    read_k, _ = cache.read_rows(0, rows)
    gathered = cache.gather(0, table, torch.float32).k.transpose(0, 1).reshape(HEADS, -1, DIM)[:, :40]
    assert torch.equal(gathered.transpose(0, 1), read_k)


def test_a_slot_needed_by_another_block_encodes_the_oldest_open_one():
    spec = KVSpec(1, HEADS, DIM, "int4")
    cache = TorchCpuAttentionBackend().allocate_kv_cache(spec, num_blocks=8, block_size=BLOCK, max_num_seqs=2)
    cache.initialize_blocks_through(7)
    k = keys(3, 5)
    for block, token in ((1, 0), (2, 1), (3, 2)):  # three blocks opened, room for two: block 1 is encoded
        rows = slot_indices(torch.tensor([block]), torch.tensor([0]), HEADS, BLOCK)
        cache.write(0, rows, k[token : token + 1], k[token : token + 1])
    slot_of = cache.open_blocks.slot_of[0]
    assert slot_of[1] < 0 and slot_of[2] >= 0 and slot_of[3] >= 0 and cache.open_blocks.encodes == 1
    rows = slot_indices(torch.tensor([1]), torch.tensor([1]), HEADS, BLOCK)
    cache.write(0, rows, k[:1], k[:1])  # written again: decoded back into a slot, its row 0 kept
    read_k, _ = cache.read_rows(0, slot_indices(torch.tensor([1]), torch.tensor([0]), HEADS, BLOCK))
    assert slot_of[1] >= 0 and (read_k[0] - k[0]).abs().max() < 0.2


def test_a_run_that_fills_one_open_block_and_starts_the_next_fits_one_slot():
    """A verify of drafts (or forced tokens) writes several rows at once: with one slot (max_num_seqs=1), filling
    the open block and starting the next must seal the first before it opens the second, bits unchanged."""
    spec = KVSpec(1, HEADS, DIM, "int4")
    k, v = keys(BLOCK + 3, 6), keys(BLOCK + 3, 7)
    table = torch.tensor([5, 2])
    reads = []
    for runs in ([range(0, BLOCK - 2), range(BLOCK - 2, BLOCK + 3)], [range(0, BLOCK - 2)]
                 + [range(p, p + 1) for p in range(BLOCK - 2, BLOCK + 3)]):
        cache = TorchCpuAttentionBackend().allocate_kv_cache(spec, num_blocks=8, block_size=BLOCK, max_num_seqs=1)
        cache.initialize_blocks_through(7)
        for run in runs:
            at = torch.tensor(list(run))
            cache.write(0, slot_indices(table[at // BLOCK], at % BLOCK, HEADS, BLOCK), k[at], v[at])
        assert cache.open_blocks.slot_of[0][5] < 0 and cache.open_blocks.slot_of[0][2] >= 0
        everything = torch.arange(BLOCK + 3)
        reads.append(cache.read_rows(0, slot_indices(table[everything // BLOCK], everything % BLOCK, HEADS, BLOCK)))
    (run_k, run_v), (one_k, one_v) = reads  # the same bits as writing one row at a time
    assert torch.equal(run_k, one_k) and torch.equal(run_v, one_v)


def test_a_block_rewritten_below_its_last_row_reopens_from_the_rows_it_was_encoded_from():
    """Rejected drafts that filled a block: the next write below its last row reopens it with the float16 rows
    it had (not decoded back from int4), unless its slot went to another block meanwhile."""
    spec = KVSpec(1, HEADS, DIM, "int4")
    cache = TorchCpuAttentionBackend().allocate_kv_cache(spec, num_blocks=8, block_size=BLOCK, max_num_seqs=3)
    cache.initialize_blocks_through(7)
    k = keys(BLOCK + 1, 3)
    for block in (1, 2):  # filled through its slot, its last row apart (a whole block at once skips the slot)
        for part in (torch.arange(BLOCK - 1), torch.tensor([BLOCK - 1])):
            cache.write(0, slot_indices(torch.full((len(part),), block), part, HEADS, BLOCK), k[part], k[part] * 2)
        assert cache.open_blocks.slot_of[0][block] < 0
    rows = torch.arange(5)

    def rewritten(block: int) -> bool:  # rewritten from row 5 on: rows 0-4 read as they were written?
        cache.write(0, slot_indices(torch.tensor([block]), torch.tensor([5]), HEADS, BLOCK), k[BLOCK:], k[BLOCK:])
        assert cache.open_blocks.slot_of[0][block] >= 0
        read_k, read_v = cache.read_rows(0, slot_indices(torch.full((5,), block), rows, HEADS, BLOCK))
        return torch.equal(read_k, k[:5].half().float()) and torch.equal(read_v, (k[:5] * 2).half().float())

    assert rewritten(1)
    # Blocks 3 and 4 take the two other slots, block 2's among them: it is decoded back from int4 (lossy).
    cache.write(0, slot_indices(torch.tensor([3, 4]), torch.tensor([0, 0]), HEADS, BLOCK), k[:2], k[:2])
    assert not rewritten(2)


def test_read_blocks_encodes_open_blocks_and_write_blocks_supersedes_them():
    spec = KVSpec(1, HEADS, DIM, "int4")
    cache = TorchCpuAttentionBackend().allocate_kv_cache(spec, num_blocks=8, block_size=BLOCK, max_num_seqs=2)
    cache.initialize_blocks_through(7)
    positions = torch.arange(5)
    rows = slot_indices(torch.full((5,), 4), positions, HEADS, BLOCK)
    cache.write(0, rows, keys(5), keys(5, 1))
    payload = cache.read_blocks([4])
    assert cache.open_blocks.slot_of[0][4] < 0  # it leaves as the pool holds it
    cache.write(0, slot_indices(torch.tensor([6]), torch.tensor([0]), HEADS, BLOCK), keys(1), keys(1))
    cache.write_blocks([6], payload)
    assert cache.open_blocks.slot_of[0][6] < 0
    assert torch.equal(cache.read_rows(0, slot_indices(torch.full((5,), 6), positions, HEADS, BLOCK))[0],
                       cache.read_rows(0, rows)[0])


def test_a_shared_prefix_block_is_encoded_once_however_many_requests_read_it(tiny_models):
    from tests.engine.test_engine import make_engine
    from tests.engine.test_prefix_caching import finish, shared_prompts

    engine = make_engine(tiny_models("llama-gqa"), kv_cache_dtype="int4")
    cache, encoded = engine.kv_cache, []
    store = cache.store_blocks
    cache.store_blocks = lambda slot, ids, *kv: (encoded.extend((slot, b) for b in ids.tolist()), store(slot, ids, *kv))
    first, *others = shared_prompts()
    finish(engine, first)
    prefix_blocks = set(encoded)
    assert len(prefix_blocks) == len(encoded) > 0  # each of its blocks encoded once, in every layer
    for prompt in others:
        assert finish(engine, prompt).num_cached_tokens == 24
    assert not prefix_blocks & set(encoded[len(prefix_blocks):])  # the shared blocks were only read
    assert len(set(encoded)) == len(encoded)  # and no block anywhere was encoded twice


def test_a_context_shift_moves_int4_keys_through_open_blocks(tiny_models):
    from kvserve.engine.engine import Engine
    from kvserve.kernels.ops import apply_rope
    from tests.engine.test_context_shift import BS, greedy, prompt, shift_config
    from tests.helpers import run_to_finals

    loaded = tiny_models("llama-1-layer")
    engine = Engine(shift_config(kv_cache_dtype="int4"), loaded=loaded)
    engine.add_request(prompt(10), greedy(20))
    while engine.scheduler.num_context_shifts == 0:
        engine.step()
    request = engine.scheduler.running[0]
    context = request.all_token_ids[: request.num_computed_tokens]
    table = engine.kv_manager.block_ids(request.request_id)[0]
    slots = engine.attention_backend.token_slots(engine.kv_cache, torch.tensor([table[p // BS] for p in range(len(context))]),
                                                 torch.tensor([p % BS for p in range(len(context))]))
    cached_k, _ = engine.kv_cache.read_rows(0, slots)
    attn = loaded.model.layers[0].self_attn
    x = loaded.model.layers[0].input_layernorm(loaded.model.embed_tokens(torch.tensor(context)))
    _, k, _ = attn.qkv_proj(x).split([attn.num_heads * attn.head_dim] + [attn.num_kv_heads * attn.head_dim] * 2, -1)
    cos, sin = loaded.model.rotary_emb(torch.arange(len(context)))
    fresh_k = apply_rope(k.view(len(context), attn.num_kv_heads, attn.head_dim), cos, sin)
    # Moved keys re-rotated and re-encoded per block: within int4's steps of the keys' range.
    assert (cached_k - fresh_k).abs().max() < 0.2 * fresh_k.abs().max()
    run_to_finals(engine)  # and generation goes on past the shift
    assert engine.scheduler.num_context_shifts >= 1
