"""The engine with a disk tier: reloaded blocks give the outputs of recompute, across restarts too."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import ConfigError
from kvserve.kv.tiers import block_file
from kvserve.kv.cache.kv_spec import kv_spec
from kvserve.model.loader import load_model
from tests.helpers import TINY_VOCAB, build_hf_model, run_to_finals, save_hf_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def make_engine(loaded, disk=None, blocks=256, **config) -> Engine:
    config.setdefault("block_size", 4)
    per_token = kv_spec(loaded.config, config.get("kv_cache_dtype", "auto")).bytes_per_token
    config.setdefault("kv_cache_memory", blocks * config["block_size"] * per_token)
    return Engine(EngineConfig(kv_disk_path=str(disk) if disk else None, **config), loaded=loaded)


def documents(count=6, length=40, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY_VOCAB, length).tolist() for _ in range(count)]


def ask(engine, prompts, salt=None):
    """Each prompt alone, in order: {index: final output}."""
    finals = []
    for prompt in prompts:
        request_id = engine.add_request(prompt, GREEDY, cache_salt=salt)
        finals.append(run_to_finals(engine)[request_id])
    return finals


def tokens(finals):
    return [f.outputs[0].token_ids for f in finals]


def tier_stats(engine):
    engine.tiers.flush()
    return engine.tiering.stats()


@pytest.mark.parametrize("dtype", ["auto", "int8"])
def test_blocks_evicted_from_the_pool_come_back_from_disk_with_the_outputs_of_recompute(tiny_models, tmp_path, dtype):
    loaded = tiny_models("llama-gqa")
    docs = documents()
    first = [doc + [7, 8, 9] for doc in docs]
    second = [doc + [11, 12] for doc in docs]  # the same documents, other questions
    # 26 blocks of 4 tokens: about two documents; each round evicts the documents asked before.
    reference = make_engine(loaded, blocks=26, kv_cache_dtype=dtype)
    expected = tokens(ask(reference, first)) + tokens(ask(reference, second))
    assert reference.stats().prefix_cache_hits == 0  # without the tier, the pool forgot every document
    tiered = make_engine(loaded, tmp_path, blocks=26, kv_cache_dtype=dtype)
    outputs = tokens(ask(tiered, first))
    tier_stats(tiered)  # every block written before the second round
    finals = ask(tiered, second)
    assert outputs + tokens(finals) == expected
    assert [f.num_cached_tokens for f in finals] == [40] * len(docs)
    assert [f.prefix_cache.num_tier_cached_tokens for f in finals] == [40] * len(docs)
    stats = tier_stats(tiered)
    assert stats.hit_tokens == 40 * len(docs) and stats.blocks_read == 10 * len(docs)
    assert stats.files_rejected == 0 and stats.writes_dropped == 0
    tiered.check_integrity()


def test_batched_preempting_workload_with_a_tier_equals_it_without(tiny_models, tmp_path):
    loaded = tiny_models("llama-gqa")
    rng = np.random.default_rng(3)
    shared = documents(3, 24, seed=3)
    prompts = [shared[i % 3] + rng.integers(1, TINY_VOCAB, int(rng.integers(1, 20))).tolist() for i in range(12)]
    params = [SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True) for n in rng.integers(4, 20, 12)]

    def run(engine):
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        finals = run_to_finals(engine)
        assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
        return [finals[i].outputs[0].token_ids for i in ids]

    expected = run(make_engine(loaded, blocks=20, enable_prefix_caching=False))
    tiered = make_engine(loaded, tmp_path, blocks=20)
    assert run(tiered) == expected
    tier_stats(tiered)
    assert run(tiered) == expected  # again, now with the disk holding every prefix
    assert tiered.stats().num_preemptions > 0 and tier_stats(tiered).hit_tokens > 0


def test_a_restart_hits_and_reports_where_each_part_came_from(tiny_models, tmp_path):
    loaded = tiny_models("llama-gqa")
    doc = documents(1, 48)[0]
    expected = tokens(ask(make_engine(loaded, enable_prefix_caching=False), [doc[:21], doc + [5]]))
    engine = make_engine(loaded, tmp_path)
    ask(engine, [doc + [3]])
    engine.close()
    restarted = make_engine(loaded, tmp_path)
    short, full = ask(restarted, [doc[:21], doc + [5]])
    assert tokens([short, full]) == expected
    assert (short.num_cached_tokens, short.prefix_cache.num_tier_cached_tokens) == (20, 20)
    # The first 20 tokens are in the pool now (loaded for `short`); the rest come from disk.
    assert (full.num_cached_tokens, full.prefix_cache.num_tier_cached_tokens) == (48, 28)
    assert "(20 from the pool, 28 from disk)" in full.prefix_cache.describe()
    restarted.check_integrity()


def test_tenants_keep_their_blocks_across_a_restart_and_never_see_each_others(tiny_models, tmp_path):
    loaded = tiny_models("llama-gqa")
    doc = documents(1, 32)[0] + [1]
    engine = make_engine(loaded, tmp_path)
    ask(engine, [doc], salt="tenant-a")
    engine.close()
    restarted = make_engine(loaded, tmp_path)
    (other,) = ask(restarted, [doc], salt="tenant-b")
    (anonymous,) = ask(restarted, [doc])
    (same,) = ask(restarted, [doc], salt="tenant-a")
    assert other.num_cached_tokens == anonymous.num_cached_tokens == 0
    assert same.prefix_cache.num_tier_cached_tokens == 32


@pytest.mark.parametrize("change", ["kv_cache_dtype", "block_size", "weights", "architecture"])
def test_another_model_or_cache_layout_never_hits(tiny_models, tmp_path, change):
    loaded = tiny_models("llama-gqa")
    doc = documents(1, 32)[0] + [1]
    engine = make_engine(loaded, tmp_path)
    ask(engine, [doc])
    engine.close()
    if change == "kv_cache_dtype":
        other = make_engine(loaded, tmp_path, kv_cache_dtype="int8")
    elif change == "block_size":
        other = make_engine(loaded, tmp_path, block_size=8, blocks=128)
    elif change == "weights":  # same architecture and shapes, other values: a fine-tune
        other = make_engine(load_model(save_hf_model(build_hf_model("llama-gqa", seed=1), tmp_path / "m")), tmp_path)
    else:
        other = make_engine(tiny_models("qwen2-bias"), tmp_path)
    (final,) = ask(other, [doc])
    assert final.num_cached_tokens == 0
    assert tier_stats(other).blocks_read == 0


def written_to_disk(loaded, disk, doc):
    """Run `doc` on an engine with a tier at `disk` and close it; returns the output of a recompute."""
    (expected,) = tokens(ask(make_engine(loaded, enable_prefix_caching=False), [doc]))
    engine = make_engine(loaded, disk)
    ask(engine, [doc])
    engine.close()
    return expected


def test_damaged_files_are_skipped_and_the_request_recomputes(tiny_models, tmp_path):
    loaded = tiny_models("llama-gqa")
    doc = documents(1, 40)[0] + [2]
    expected = written_to_disk(loaded, tmp_path, doc)
    files = sorted(tmp_path.rglob("*" + block_file.SUFFIX))
    for number, path in enumerate(files):
        data = path.read_bytes()
        # Every third file truncated, the others with a flipped byte in their K/V.
        path.write_bytes(data[: len(data) // 2] if number % 3 == 0 else data[:-3] + bytes([data[-3] ^ 0x40]) + data[-2:])
    restarted = make_engine(loaded, tmp_path)
    (final,) = ask(restarted, [doc])
    assert final.outputs[0].token_ids == expected
    assert final.num_cached_tokens == 0
    assert tier_stats(restarted).files_rejected >= 1
    restarted.check_integrity()


def test_an_unexpected_tier_error_turns_the_tier_off_and_serving_goes_on(tiny_models, tmp_path, caplog):
    loaded = tiny_models("llama-gqa")
    doc = documents(1, 40)[0] + [2]
    expected = written_to_disk(loaded, tmp_path, doc)
    restarted = make_engine(loaded, tmp_path)

    def broken(block_ids, payloads):
        raise MemoryError("no room to copy")

    restarted.kv_cache.write_blocks = broken
    (final,) = ask(restarted, [doc])
    assert final.outputs[0].token_ids == expected and final.num_cached_tokens == 0
    assert "KV disk tier turned off" in caplog.text
    assert restarted.stats().tier.enabled is False
    restarted.check_integrity()
    assert restarted.kv_manager.num_cached_blocks == 11  # its own 46 computed tokens; nothing half-loaded


def test_the_tier_needs_prefix_caching():
    with pytest.raises(ConfigError, match="prefix caching"):
        EngineConfig(kv_disk_path="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="kv_disk_size"):
        EngineConfig(kv_disk_path="/tmp/x", kv_disk_size="lots")


_CHILD = """
import json, sys
from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.model.loader import load_model
from tests.helpers import run_to_finals
model, disk, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
engine = Engine(EngineConfig(kv_disk_path=disk, block_size=4, kv_cache_memory=1 << 20), loaded=load_model(model))
request_id = engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
final = run_to_finals(engine)[request_id]
print(json.dumps({"tokens": final.outputs[0].token_ids, "from_disk": final.prefix_cache.num_tier_cached_tokens}))
"""


def test_a_new_process_hits_what_an_earlier_one_wrote(tiny_models, tmp_path):
    model = tiny_models("llama-gqa").source
    prompt = json.dumps(documents(1, 36)[0] + [4])
    env = dict(os.environ, PYTHONHASHSEED="random")  # block hashes must not depend on the process

    def child():
        done = subprocess.run([sys.executable, "-c", _CHILD, model, str(tmp_path / "tier"), prompt], env=env,
                              cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = child(), child()  # the first never calls close(): its exit still flushes the writes
    assert first["from_disk"] == 0 and second["from_disk"] == 36
    assert first["tokens"] == second["tokens"]


def test_write_through_skips_what_a_load_brought_from_a_tier_but_fills_the_other_tiers():
    from kvserve.kv.prefix.hashing import block_hashes
    from kvserve.kv.manager import KVCacheManager
    from kvserve.kv.tiers.connector import LoadResult, TierConnector
    from kvserve.kv.tiers.traffic import TierTraffic
    from tests.kv.tiers.fakes import BytesCache, DictTier

    near, far = DictTier("host"), DictTier("disk")
    for tier in (near, far):
        tier.contains = lambda block_hash: False  # no pre-filter: only where a block came from stops a store
    connector = TierConnector([near, far])
    kv = KVCacheManager(16, 4, watermark=0.0, enable_caching=True, tiers=connector)
    cache = BytesCache(16)
    traffic = TierTraffic(connector, kv, cache)
    tokens = list(range(1, 22))
    chain = block_hashes(tokens, 4)
    assert kv.allocate_slots("a", 12)
    cache.write_blocks(kv.block_ids("a")[0], [b"a0", b"a1", b"a2"])
    kv.cache_full_blocks("a", tokens, chain, 12)
    traffic.write_through()
    assert list(near.blocks.values()) == list(far.blocks.values()) == [b"a0", b"a1", b"a2"]
    kv.free("a")
    kv.pool.reset_cache()  # the pool forgets; the tiers still hold blocks 0-2
    near.blocks.clear()
    match = kv.match_prefix(tokens, chain)
    assert match.tier.tier == 1 and match.num_tier_tokens == 12
    assert kv.allocate_slots("b", match.num_tokens, prefix=match)
    load = kv.tier_load("b", match)
    cache.write_blocks(list(load.block_ids), connector.load(load.hit))
    far.stored_again = []
    far.store = far.stored_again.extend
    assert traffic.loads_finished([LoadResult(load, 3)]) == {"b": 3}
    kv.cache_full_blocks("b", tokens, chain, 12)
    traffic.write_through()
    assert far.stored_again == []  # what it loaded from the disk is there already
    assert list(near.blocks.values()) == [b"a0", b"a1", b"a2"]  # the tier above it gets them
    traffic.close()
    kv.free("b")
    kv.check_integrity()
