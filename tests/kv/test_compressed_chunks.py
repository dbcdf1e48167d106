"""Where a compressing request's prompt is compressed: chunk boundaries, stops and dropped counts."""

from kvserve.kv.compressed_chunks import ChunkPolicy


def test_chunks_compressed_only_where_the_prompt_goes_on_a_window_past_them():
    assert ChunkPolicy(16, 8, 4, 60).num_chunks == 3  # 48 + 4 <= 60, 64 + 4 > 60
    assert ChunkPolicy(16, 8, 4, 52).num_chunks == 3
    assert ChunkPolicy(16, 8, 4, 51).num_chunks == 2
    assert ChunkPolicy(16, 8, 0, 48).num_chunks == 2  # a compressed chunk is always followed by a prompt token
    assert ChunkPolicy(16, 8, 4, 10).num_chunks == 0


def test_a_step_stops_at_the_end_of_a_compressed_chunk():
    policy = ChunkPolicy(16, 8, 4, 60)
    assert policy.stop(0, 100) == 16
    assert policy.stop(10, 100) == 6
    assert policy.stop(16, 5) == 5
    assert policy.stop(40, 100) == 8
    assert policy.stop(48, 100) == 100  # chunk 3 is not compressed: the tail and decode run on


def test_dropped_tokens_count_chunks_wholly_before_the_last_token():
    policy = ChunkPolicy(16, 4, 4, 60)
    assert [policy.dropped(n) for n in (0, 16, 17, 33, 49, 80)] == [0, 0, 12, 24, 36, 36]
