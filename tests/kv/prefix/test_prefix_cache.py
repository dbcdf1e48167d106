"""Prefix caching in the KV manager and block pool: hashing, sharing, salts, LRU eviction."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.prefix.hashing import block_hashes
from kvserve.kv.manager import KVCacheManager

BS = 4


def manager(num_blocks=16):
    return KVCacheManager(num_blocks, BS, watermark=0.0, enable_caching=True)


def lookup(kv, tokens, salt=None):
    """The cached prefix of `tokens`, hashed as a request would hash them."""
    return kv.find_cached_prefix(tokens, block_hashes(tokens, BS, salt))


def run_request(kv, request_id, tokens, salt=None, finish=True):
    """Admit with whatever prefix is cached, 'compute' every token, optionally finish."""
    chain = block_hashes(tokens, BS, salt)
    match = kv.find_cached_prefix(tokens, chain)
    assert kv.allocate_slots(request_id, len(tokens), prefix=match)
    kv.cache_full_blocks(request_id, tokens, chain, len(tokens))
    if finish:
        kv.free(request_id)
    kv.check_integrity()
    return match


def test_identical_prefix_is_shared_not_copied():
    kv = manager()
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    run_request(kv, "a", prompt, finish=False)
    match = lookup(kv, prompt + [99])
    assert match.num_tokens == 12
    assert kv.allocate_slots("b", 14, prefix=match)
    assert kv.block_ids("b")[0][:3] == kv.block_ids("a")[0][:3]  # the same physical blocks
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids("a")[0][:3]] == [2, 2, 2]
    kv.check_integrity()


def test_hit_is_capped_so_one_token_is_computed():
    kv = manager()
    prompt = list(range(1, 13))  # exactly 3 blocks
    run_request(kv, "a", prompt)
    assert lookup(kv, prompt).num_tokens == 8  # not 12: the last token needs computing
    assert lookup(kv, prompt + [50]).num_tokens == 12


def test_hash_chains_through_parents():
    kv = manager()
    run_request(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # the same second block after a different first block is a different chain
    assert lookup(kv, [9, 9, 9, 9, 5, 6, 7, 8, 1]).num_tokens == 0
    assert lookup(kv, [1, 2, 3, 4, 9, 9, 9, 9, 1]).num_tokens == 4


def test_salts_never_share():
    kv = manager()
    prompt = list(range(1, 10))
    run_request(kv, "a", prompt, salt="tenant-a")
    assert lookup(kv, prompt, "tenant-b").num_tokens == 0
    assert lookup(kv, prompt, None).num_tokens == 0
    assert lookup(kv, prompt, "tenant-a").num_tokens == 8
    # nor does a miss explanation look at another salt's blocks
    assert kv.find_divergence(prompt, lookup(kv, prompt, "tenant-b")) is None


def test_collision_never_serves_other_tokens():
    kv = manager()
    run_request(kv, "a", [1, 2, 3, 4, 5])
    (block,) = kv.pool.cached.values()
    block.token_ids = (7, 7, 7, 7)  # as if another content had produced the same hash
    assert lookup(kv, [1, 2, 3, 4, 5]).num_tokens == 0


def test_freed_blocks_stay_cached_until_reused_and_are_claimed_back():
    kv = manager(num_blocks=4)
    run_request(kv, "a", list(range(1, 10)))  # 3 blocks, 2 of them full and hashed, all freed
    assert kv.num_free_blocks == 4 and len(kv.pool.cached) == 2
    match = lookup(kv, list(range(1, 10)))
    assert match.num_tokens == 8
    assert kv.allocate_slots("b", 9, prefix=match)  # takes the 2 cached blocks back out of the free queue
    assert kv.num_free_blocks == 1
    kv.check_integrity()


def test_eviction_takes_chain_tails_before_roots():
    kv = manager(num_blocks=4)
    run_request(kv, "a", list(range(1, 14)))  # 4 blocks: 3 hashed
    # freed tail-first: the free queue holds the chain's end first
    assert [b.block_id for b in kv.pool.free_queue] == [3, 2, 1, 0]
    assert kv.allocate_slots("b", 4)  # one fresh block: evicts the unhashed tail block 3
    assert lookup(kv, list(range(1, 14))).num_tokens == 12
    assert kv.allocate_slots("c", 4)  # the next one evicts block 2, the chain's last hashed block
    assert lookup(kv, list(range(1, 14))).num_tokens == 8  # the root survives
    kv.check_integrity()


def test_admission_counts_claimed_cached_blocks_against_free_space():
    kv = manager(num_blocks=3)
    run_request(kv, "a", list(range(1, 10)))  # blocks 0,1 cached & free, block 2 free
    match = lookup(kv, list(range(1, 10)) + [1, 2, 3, 4])  # 13 tokens: needs 4 blocks, 2 shared
    assert not kv.allocate_slots("b", 13, prefix=match)
    assert kv.block_ids("b")[0] == [] and kv.num_free_blocks == 3
    kv.check_integrity()


def test_divergence_names_the_first_differing_token():
    kv = manager()
    run_request(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    prompt = [1, 2, 3, 4, 5, 6, 70, 8, 9, 10]  # differs at position 6, inside block 1
    match = lookup(kv, prompt)
    assert match.num_tokens == 4
    divergence = kv.find_divergence(prompt, match)
    assert divergence.position == 6 and divergence.cached_token_ids == (5, 6, 7, 8)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(1, 3), min_size=1, max_size=14),
                          st.sampled_from(["run", "hold", "free"])), max_size=40))
def test_invariants_with_sharing(ops):
    """Random prompts over a tiny alphabet (so prefixes collide often), held or finished at random."""
    kv = manager(num_blocks=12)
    held: set[str] = set()
    for index, (rid, tokens, op) in enumerate(ops):
        request_id = f"r{rid}"
        if op == "free" or request_id in held:
            kv.free(request_id)
            held.discard(request_id)
        else:
            chain = block_hashes(tokens, BS)
            match = kv.find_cached_prefix(tokens, chain)
            if kv.allocate_slots(request_id, len(tokens), prefix=match):
                kv.cache_full_blocks(request_id, tokens, chain, len(tokens))
                # a hit's blocks hold exactly the prompt's tokens
                for i, block_id in enumerate(kv.block_ids(request_id)[0][: match.num_tokens // BS]):
                    assert kv.pool.blocks[block_id].token_ids == tuple(tokens[i * BS : (i + 1) * BS])
                if op == "run":
                    kv.free(request_id)
                else:
                    held.add(request_id)
        kv.check_integrity()
    for request_id in held:
        kv.free(request_id)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
