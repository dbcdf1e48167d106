"""KV compression with the disk tier (issue 43): compressed chunks' kept blocks go to disk as they are, under keys
that name their chunk and chain the spec, and come back for a later request (or a restarted engine) with the same
prefix and spec, with the tokens a cold run gives; a plain request or another spec never reads them."""

import pytest

from kvserve.engine.sample.sampling import SamplingParams
from kvserve.kv.compression import CompressionSpec
from kvserve.kv.tiers import block_file
from tests.engine.test_tiering import documents, make_engine, tier_stats, tokens
from tests.helpers import run_to_finals

CHUNK = 16
SPEC = CompressionSpec("knorm", 2.0, sinks=2, window=4, chunk=CHUNK)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# 60-token documents: chunks 0..2 compressed to 2 kept blocks each (48 tokens in 6 blocks), then 3 token blocks
# chained from the compressed chain: a question after a document hits 60 tokens through 9 blocks.
DOC, HIT_BLOCKS = 60, 9


def compressing(engine, spec=SPEC):
    engine.compression.default = spec  # the flag's chunk is 512: tests use 16-token chunks
    return engine


def ask(engine, prompts):
    finals = []
    for prompt in prompts:
        request_id = engine.add_request(prompt, GREEDY)
        finals.append(run_to_finals(engine)[request_id])
    return finals


def kept_files(directory):
    """The kept blocks' files on disk (a compressed chunk's: KVSBLK02) and the token blocks' (KVSBLK01)."""
    heads = [path.read_bytes()[:8] for path in directory.rglob("*" + block_file.SUFFIX)]
    return heads.count(block_file.MAGIC_KEPT), heads.count(block_file.MAGIC)


@pytest.fixture
def rounds(tiny_models):
    loaded = tiny_models("llama-gqa")
    docs = documents(4, DOC, seed=11)
    first = [doc + [7, 8, 9] for doc in docs]
    second = [doc + [11, 12] for doc in docs]  # the same documents, other questions
    # 22 blocks: about two compressed documents; each round evicts the documents asked before from the pool.
    reference = compressing(make_engine(loaded, blocks=22))
    expected = tokens(ask(reference, first)) + tokens(ask(reference, second))
    assert reference.stats().prefix_cache_hits == 0  # without the tier, the pool forgot every document
    return loaded, first, second, expected


def test_compressed_blocks_evicted_from_the_pool_come_back_from_disk_with_the_same_tokens(rounds, tmp_path):
    loaded, first, second, expected = rounds
    tiered = compressing(make_engine(loaded, tmp_path, blocks=22))
    outputs = tokens(ask(tiered, first))
    tier_stats(tiered)  # every block written before the second round
    num_kept, num_token_blocks = kept_files(tmp_path)
    assert num_kept == 6 * len(first) and num_token_blocks >= 3 * len(first)  # as they are: kept blocks say so
    finals = ask(tiered, second)
    assert outputs + tokens(finals) == expected
    assert [f.prefix_cache.num_tier_cached_tokens for f in finals] == [DOC] * len(second)
    assert all(f.num_dropped_tokens == 3 * CHUNK // 2 for f in finals)
    stats = tier_stats(tiered)
    assert stats.blocks_read == HIT_BLOCKS * len(second) and stats.files_rejected == 0
    tiered.check_integrity()  # every file's key hashes to its name, kept blocks' extra keys included
    assert tiered.kv_manager.num_free_blocks == tiered.kv_manager.num_blocks


def test_a_restarted_engine_restores_them_and_a_plain_request_or_another_spec_never_reads_them(rounds, tmp_path):
    loaded, first, second, expected = rounds
    engine = compressing(make_engine(loaded, tmp_path, blocks=22))
    ask(engine, first)
    engine.close()
    restarted = compressing(make_engine(loaded, tmp_path, blocks=22))
    finals = ask(restarted, second)
    assert tokens(finals) == expected[len(first):]
    assert [f.prefix_cache.num_tier_cached_tokens for f in finals] == [DOC] * len(second)
    restarted.check_integrity()
    plain = compressing(make_engine(loaded, tmp_path, blocks=22), None)
    other = compressing(make_engine(loaded, tmp_path, blocks=22), CompressionSpec("knorm", 4.0, sinks=2, window=4,
                                                                                   chunk=CHUNK))
    for engine in (plain, other):
        assert [f.num_cached_tokens for f in ask(engine, second[:2])] == [0, 0]
        assert tier_stats(engine).hit_tokens == 0


def test_a_load_cut_inside_a_chunk_keeps_the_whole_chunks_and_recomputes_the_rest(rounds, tmp_path):
    loaded, first, second, expected = rounds
    engine = compressing(make_engine(loaded, tmp_path, blocks=22))
    ask(engine, first)
    tier_stats(engine)
    disk = engine.tiers.named("disk")
    load = disk.load
    disk.load = lambda keys: load(keys)[:3]  # chunk 0's two kept blocks, then the first of chunk 1's
    finals = ask(engine, second)
    assert tokens(finals) == expected[len(first):]
    assert [f.num_cached_tokens for f in finals] == [CHUNK] * len(second)  # chunk 0 only
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_the_flag_runs_with_a_disk_tier_and_drafting(tiny_models, tmp_path):
    # Neither is refused any more; the others still are (tests/engine/test_kv_compression.py).
    engine = make_engine(tiny_models("llama-gqa"), tmp_path, kv_compression="knorm:2", speculative="ngram")
    assert engine.compression.default is not None and engine.drafting is not None and engine.tiers is not None
    engine.close()
