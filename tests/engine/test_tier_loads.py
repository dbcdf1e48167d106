"""Tier blocks come back off the compute thread: one lookup per admission, a slow read stalls nobody else,
a bad entry is recomputed, an abort mid-read frees everything; the answer never depends on the tier."""

import threading

import pytest

from kvserve.engine.output.types import RequestOutputAssembler
from kvserve.kv.prefix.hashing import block_hashes
from kvserve.kv.tiers import block_file
from kvserve.kv.tiers.connector import BlockKey
from kvserve.kv.tiers.disk_files import block_path
from tests.engine.test_tiering import GREEDY, ask, documents, make_engine, tier_stats, tokens
from tests.helpers import run_to_finals

BS = 4


def written(loaded, disk, prompts):
    """Run `prompts` on an engine with a tier at `disk` and close it; the outputs a cold engine computes."""
    expected = tokens(ask(make_engine(loaded, enable_prefix_caching=False), prompts))
    engine = make_engine(loaded, disk)
    ask(engine, prompts)
    engine.close()
    return expected


def gated(engine):
    """Make the disk tier's reads wait for the returned event (set it to let them through)."""
    disk, gate = engine.tiers.named("disk"), threading.Event()
    load = disk.load

    def slow_load(keys):
        assert gate.wait(60), "the read was never let through"
        return load(keys)

    disk.load = slow_load
    return gate


def counting(obj, name):
    calls = []
    original = getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


def test_each_admission_looks_the_prefix_up_once_in_the_pool_and_the_tier(tiny_models, tmp_path):
    loaded = tiny_models("llama-gqa")
    docs = documents(2, 40, seed=5)
    expected = written(loaded, tmp_path, [docs[0] + [3], docs[1] + [3]])
    engine = make_engine(loaded, tmp_path)
    pool_lookups = counting(engine.kv_manager.prefix, "find_cached_prefix")
    tier_lookups = counting(engine.tiers.named("disk"), "lookup")
    prompts = [docs[0] + [3], documents(1, 30, seed=9)[0], docs[1] + [3]]  # hit, miss, hit
    ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]
    finals = run_to_finals(engine)
    assert (len(pool_lookups), len(tier_lookups)) == (3, 3)
    assert [finals[i].prefix_cache.num_tier_cached_tokens for i in ids] == [40, 0, 40]
    assert [finals[i].outputs[0].token_ids for i in (ids[0], ids[2])] == expected


def test_a_slow_tier_read_stalls_no_step_and_its_request_gets_the_answer_of_a_cold_run(tiny_models, tmp_path):
    loaded = tiny_models("llama-gqa")
    doc, other = documents(1, 40, seed=6)[0] + [2], documents(1, 24, seed=7)[0]
    cold = tokens(ask(make_engine(loaded, enable_prefix_caching=False), [doc, other]))
    written(loaded, tmp_path, [doc])
    engine = make_engine(loaded, tmp_path)
    gate = gated(engine)
    waiting, busy = engine.add_request(doc, GREEDY), engine.add_request(other, GREEDY)
    assembler, finals, steps = RequestOutputAssembler(), {}, 0
    while busy not in finals:  # the other request runs to its end while the read is held back
        for delta in engine.step():
            if (final := assembler.add(delta)) is not None:
                finals[final.request_id] = final
        steps += 1
        engine.check_integrity()
        assert engine.stats().request(waiting).status == "loading"
        assert engine.kv_manager.num_blocks_held(waiting) == 10  # its blocks are held, not parked
    assert steps >= GREEDY.max_tokens
    gate.set()
    finals.update(run_to_finals(engine))
    assert [finals[waiting].outputs[0].token_ids, finals[busy].outputs[0].token_ids] == cold
    assert finals[waiting].prefix_cache.num_tier_cached_tokens == 40
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    engine.close()


def corrupt_checksum(directory, key):
    path = block_path(directory, key.block_hash)
    data = path.read_bytes()
    path.write_bytes(data[:-7] + bytes([data[-7] ^ 0x10]) + data[-6:])


def corrupt_fingerprint(directory, key):
    path = block_path(directory, key.block_hash)
    header = block_file.read_header(path.read_bytes())
    payload = path.read_bytes()[header.header_len :]
    path.write_bytes(block_file.encode(bytes(16), key, payload))  # the same block, made by something else


@pytest.mark.parametrize("corrupt", [corrupt_checksum, corrupt_fingerprint])
def test_a_tier_entry_that_fails_its_check_is_recomputed_and_the_blocks_before_it_are_used(tiny_models, tmp_path,
                                                                                           corrupt):
    loaded = tiny_models("llama-gqa")
    doc = documents(1, 40, seed=8)[0] + [2]
    (expected,) = written(loaded, tmp_path, [doc])
    engine = make_engine(loaded, tmp_path)  # indexed every block; the read finds block 5 bad
    chain = block_hashes(doc, BS)
    corrupt(engine.tiers.named("disk").directory, BlockKey(chain.hashes[5], chain.parent(5), tuple(doc[20:24])))
    (final,) = ask(engine, [doc])
    assert final.outputs[0].token_ids == expected
    assert (final.num_cached_tokens, final.prefix_cache.num_tier_cached_tokens) == (20, 20)
    assert tier_stats(engine).files_rejected == 1
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_an_abort_while_the_read_is_in_flight_frees_every_block_and_nothing_lands_in_them(tiny_models, tmp_path):
    loaded = tiny_models("llama-gqa")
    doc, after = documents(1, 40, seed=10)[0] + [2], documents(1, 36, seed=11)[0]
    written(loaded, tmp_path, [doc])
    (expected,) = tokens(ask(make_engine(loaded, enable_prefix_caching=False), [after]))
    engine = make_engine(loaded, tmp_path)
    gate = gated(engine)
    copies = counting(engine.kv_cache, "write_blocks")
    request_id = engine.add_request(doc, GREEDY)
    assert engine.step() == []
    assert engine.stats().request(request_id).status == "loading" and engine.runner.loads_in_flight()
    assert engine.kv_manager.num_blocks_held(request_id) == 10
    assert engine.abort(request_id).finished
    engine.check_integrity()
    assert not engine.has_unfinished() and not engine.runner.loads_in_flight()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    gate.set()  # the read ends after all: what it read goes nowhere
    (final,) = ask(engine, [after])  # the freed blocks serve someone else, cleanly
    engine.close()  # waits for the reader thread
    assert final.outputs[0].token_ids == expected
    assert copies == []


def test_requests_on_one_tier_prefix_read_it_once_and_the_later_ones_hit_the_pool(tiny_models, tmp_path):
    loaded = tiny_models("llama-gqa")
    doc = documents(1, 40, seed=12)[0]
    prompts = [doc + [3], doc + [4, 5], doc + [6]]
    expected = written(loaded, tmp_path, prompts[:1]) + tokens(ask(make_engine(loaded, enable_prefix_caching=False),
                                                                   prompts[1:]))
    engine = make_engine(loaded, tmp_path)
    ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]  # admitted in one step, together
    finals = run_to_finals(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == expected
    assert [finals[i].prefix_cache.num_tier_cached_tokens for i in ids] == [40, 0, 0]
    assert [finals[i].num_cached_tokens for i in ids] == [40, 40, 40]
    assert tier_stats(engine).blocks_read == 10
