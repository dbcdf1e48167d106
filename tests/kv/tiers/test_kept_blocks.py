"""A compressed chunk's kept blocks in the disk tier (KV compression, issue 43): their files say what they are
(KVSBLK02, the extra keys their hash chains), round-trip, survive a restart, and a key without its extra keys (a
token block of the same tokens) never reads them."""

import pytest

from kvserve.errors import KVIntegrityError
from kvserve.kv.prefix.compressed_keys import slot_keys
from kvserve.kv.compressed_chunks import ChunkPolicy
from kvserve.kv.prefix.compressed_tier import tier_key
from kvserve.kv.prefix.hashing import block_hashes
from kvserve.kv.tiers import block_file
from kvserve.kv.tiers.connector import BlockKey
from tests.kv.tiers.test_disk import BLOCK, FINGERPRINT, PAYLOAD, make_tier, payload, stored

CHUNK = 16


def compressed_keys(token_ids, salt="spec"):
    """A compressing request's slot keys as a tier stores them: 2 chunks of 16 tokens keep 2 blocks each, then
    token blocks chained from the compressed chain."""
    chain = block_hashes(token_ids, BLOCK, salt)
    return [tier_key(key) for key in slot_keys(ChunkPolicy(CHUNK, 8, 4, len(token_ids)), chain, token_ids)]


def test_a_kept_block_file_round_trips_and_says_what_it_is():
    keys = compressed_keys(list(range(40)))
    kept, later = keys[0], keys[4]
    assert kept.is_kept_block and not later.is_kept_block
    data = block_file.encode(FINGERPRINT, kept, payload(1))
    assert data[:8] == block_file.MAGIC_KEPT and block_file.read_header(data).key == kept
    assert len(data) == block_file.file_len(kept, PAYLOAD)
    assert block_file.decode(data, FINGERPRINT, kept, PAYLOAD) == payload(1)
    assert block_file.encode(FINGERPRINT, later, payload(2))[:8] == block_file.MAGIC  # a token block: as before
    stripped = BlockKey(kept.block_hash, kept.parent_hash, kept.token_ids)  # its tokens, not what it holds
    with pytest.raises(block_file.BlockFileError):
        block_file.decode(data, FINGERPRINT, stripped, PAYLOAD)
    with pytest.raises(block_file.BlockFileError):
        block_file.read_header(data[:70])  # truncated inside the extra keys' header


def test_kept_blocks_are_stored_restored_after_a_restart_and_checked(tmp_path):
    keys = compressed_keys(list(range(40)))
    tier = stored(make_tier(tmp_path), keys)
    tier.check_integrity()  # each key hashes to its name with its extra keys
    tier.close()
    restarted = make_tier(tmp_path)
    assert restarted.stats().num_blocks == len(keys) and restarted.stats().files_rejected == 0
    assert restarted.lookup(keys) == len(keys)
    assert [bytes(p) for p in restarted.load(keys)] == [payload(i) for i in range(len(keys))]
    stripped = [BlockKey(k.block_hash, k.parent_hash, k.token_ids) for k in keys]
    assert restarted.lookup(stripped) == 0  # the same hash without what it names is another key: a miss
    restarted.check_integrity()
    # A key that does not hash to its name with its extra keys is refused by the integrity check.
    restarted._index[keys[0].block_hash].key = BlockKey(keys[0].block_hash, keys[0].parent_hash, keys[0].token_ids,
                                                        b"forged")
    with pytest.raises(KVIntegrityError):
        restarted.check_integrity()


def test_another_spec_or_no_compression_has_other_keys(tmp_path):
    tokens = list(range(40))
    tier = stored(make_tier(tmp_path), compressed_keys(tokens))
    assert tier.lookup(compressed_keys(tokens, salt="another spec")) == 0
    plain = block_hashes(tokens, BLOCK, "spec")
    assert tier.lookup([BlockKey(plain.hashes[0], plain.parent(0), tuple(tokens[:BLOCK]))]) == 0
