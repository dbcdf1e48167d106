"""The lab's record of which prompt tokens each layer and KV head kept (engine/observe/kept_tokens.py)."""

import torch

from kvserve.kv.compression.compact import chunk_slots, kept_indices
from tests.engine.test_kv_compression import CHUNK, engine_with, greedy, prompt, run, spec
from tests.helpers import run_to_finals


def recording(loaded, compression, keep_finished=16):
    engine = engine_with(loaded, compression)
    engine.kept_tokens.enable()
    engine.kept_tokens.keep_finished = keep_finished
    return engine


def test_off_until_enabled(tiny_models):
    engine = engine_with(tiny_models("llama-gqa"), spec())
    request_id = engine.add_request(prompt(60), greedy())
    run_to_finals(engine)
    assert engine.kept_tokens.get(request_id) is None and engine.kept_tokens.requests() == []


def test_streaming_keeps_the_sinks_then_each_chunks_most_recent_tokens(tiny_models):
    loaded = tiny_models("llama-gqa")
    engine = recording(loaded, spec(method="streaming", ratio=2.0, sinks=2))
    request_id = engine.add_request(prompt(60), greedy())
    record = engine.kept_tokens.get(request_id)
    assert record.num_chunks == 3 and record.chunks == {} and not record.finished
    run_to_finals(engine)
    record = engine.kept_tokens.get(request_id)
    assert record.finished and sorted(record.chunks) == [0, 1, 2] and record.cached_chunks == []
    layers, heads, budget = loaded.config.num_layers, loaded.config.num_kv_heads, CHUNK // 2
    for index, chunk in record.chunks.items():
        assert chunk.first_position == index * CHUNK and chunk.chunk == CHUNK
        assert chunk.kept.dtype == torch.int16 and chunk.kept.shape == (layers, heads, budget)
        recent = list(range(CHUNK - budget, CHUNK))
        expected = [0, 1, *recent[2:]] if index == 0 else recent  # chunk 0 keeps its attention sinks
        assert (chunk.kept == torch.tensor(expected, dtype=torch.int16)).all()


def test_knorm_record_is_the_kept_set_of_the_chunks_keys(tiny_models):
    # The kept set the record shows is what kept_indices picks from the keys the cache held for the chunk, read
    # back here from an uncompressed engine's pool. Those are the same bits where the keys do not depend on what
    # earlier chunks kept: every layer of chunk 0, and layer 0 (embeddings only) of every chunk.
    loaded = tiny_models("llama-gqa")
    tokens = prompt(60, seed=3)
    engine = recording(loaded, spec(method="knorm", ratio=4.0))
    request_id = engine.add_request(tokens, greedy(max_tokens=1))
    run_to_finals(engine)
    record = engine.kept_tokens.get(request_id)
    plain = engine_with(loaded, None)
    plain_id = plain.add_request(tokens, greedy(max_tokens=1))
    while plain.scheduler.requests[plain_id].num_computed_tokens < 48:  # the three compressed chunks' K/V
        plain.step()
    cache, blocks = plain.kv_cache, plain.kv_manager.block_ids(plain_id)[0]
    for index, chunk in record.chunks.items():
        slots = chunk_slots(plain.attention_backend, cache, blocks[index * 4:(index + 1) * 4], CHUNK)
        positions = torch.arange(index * CHUNK, (index + 1) * CHUNK)
        for layer in range(cache.spec.num_layers) if index == 0 else [0]:
            k, v = cache.read_rows(layer, slots.reshape(-1))
            want = kept_indices(k.transpose(0, 1), v.transpose(0, 1), positions, spec(method="knorm", ratio=4.0),
                                CHUNK // 4, 2 if index == 0 else 0)
            assert torch.equal(chunk.kept[layer].long(), want), (index, layer)


def test_bounded_finished_records_and_prefix_hits_name_their_cached_chunks(tiny_models):
    loaded = tiny_models("llama-gqa")
    engine = recording(loaded, spec(), keep_finished=2)
    tokens = prompt(60, seed=5)
    ids = []
    for extra in range(3):
        ids.append(engine.add_request(tokens[:56] + prompt(4, seed=10 + extra), greedy(max_tokens=2)))
        run_to_finals(engine)
    first, second, third = (engine.kept_tokens.get(i) for i in ids)
    assert first is None  # only the last two finished requests are kept
    assert [r.request_id for r in engine.kept_tokens.requests()] == [ids[2], ids[1]]
    assert second.chunks == {} and second.cached_chunks == [0, 1, 2]  # all three came from the prefix cache
    assert engine.kept_tokens.num_bytes == 0
    cold = recording(loaded, spec())
    cold_id = cold.add_request(tokens[:56] + prompt(4, seed=10), greedy(max_tokens=2))
    run_to_finals(cold)
    assert cold.kept_tokens.num_bytes == 3 * loaded.config.num_layers * loaded.config.num_kv_heads * 8 * 2
    assert third.finished and cold.kept_tokens.get(cold_id).cached_chunks == []
