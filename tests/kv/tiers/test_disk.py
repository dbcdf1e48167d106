"""The disk tier on its own: format, write-through, LRU capacity, bad files, a disk that fails."""

import os
import stat

import pytest

from kvserve.errors import KVIntegrityError
from kvserve.kv.prefix.hashing import block_hashes
from kvserve.kv.tiers import block_file
from kvserve.kv.tiers.connector import BlockKey
from kvserve.kv.tiers.disk import DiskTier
from kvserve.kv.tiers.disk_files import block_path

BLOCK = 4
PAYLOAD = 64
FINGERPRINT = bytes(range(16))


def keys_for(token_ids, salt=None):
    chain = block_hashes(token_ids, BLOCK, salt)
    return [BlockKey(chain.hashes[i], chain.parent(i), tuple(token_ids[i * BLOCK : (i + 1) * BLOCK]))
            for i in range(len(chain))]


def payload(i: int) -> bytes:
    return bytes((i + j) % 251 for j in range(PAYLOAD))


def make_tier(path, capacity=1 << 20, fingerprint=FINGERPRINT, block=BLOCK, payload_len=PAYLOAD) -> DiskTier:
    return DiskTier(path, capacity, fingerprint, block, payload_len)


def stored(tier, keys):
    tier.store([(key, payload(i)) for i, key in enumerate(keys)])
    tier.flush()
    return tier


def test_block_file_round_trip_and_every_mismatch_is_refused():
    key = keys_for(list(range(8)))[1]
    data = block_file.encode(FINGERPRINT, key, payload(3))
    assert block_file.decode(data, FINGERPRINT, key, PAYLOAD) == payload(3)
    other = keys_for(list(range(1, 9)))[1]
    cases = {
        "fingerprint": lambda: block_file.decode(data, bytes(16), key, PAYLOAD),
        "another block": lambda: block_file.decode(data, FINGERPRINT, other, PAYLOAD),
        "payload size": lambda: block_file.decode(data, FINGERPRINT, key, PAYLOAD + 1),
        "truncated": lambda: block_file.decode(data[:-1], FINGERPRINT, key, PAYLOAD),
        "truncated header": lambda: block_file.decode(data[:30], FINGERPRINT, key, PAYLOAD),
        "flipped payload bit": lambda: block_file.decode(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:],
                                                         FINGERPRINT, key, PAYLOAD),
        "not ours": lambda: block_file.decode(b"\x80\x04\x95" + data[3:], FINGERPRINT, key, PAYLOAD),  # a pickle
    }
    for name, case in cases.items():
        with pytest.raises(block_file.BlockFileError):
            case()
            pytest.fail(name)


def test_store_then_load_in_a_new_instance(tmp_path):
    keys = keys_for(list(range(100, 120)))
    stored(make_tier(tmp_path), keys).close()
    tier = make_tier(tmp_path)  # a restart: the index is rebuilt from the files
    assert tier.lookup(keys) == len(keys)
    assert tier.load(keys) == [payload(i) for i in range(len(keys))]
    stats = tier.stats()
    assert (stats.num_blocks, stats.blocks_read, stats.hit_tokens, stats.query_tokens) == (5, 5, 20, 20)
    tier.check_integrity()


def test_lookup_is_the_longest_consecutive_run_and_a_collision_is_a_miss(tmp_path):
    keys = keys_for(list(range(40)))
    tier = stored(make_tier(tmp_path), keys[:3] + keys[4:])
    assert tier.lookup(keys) == 3
    forged = BlockKey(keys[0].block_hash, keys[0].parent_hash, (9, 9, 9, 9))  # same digest, other tokens
    assert tier.lookup([forged]) == 0
    assert tier.load([forged]) == []


def test_salted_chains_never_meet(tmp_path):
    tokens = list(range(16))
    tier = stored(make_tier(tmp_path), keys_for(tokens, salt="tenant-a"))
    assert tier.lookup(keys_for(tokens, salt="tenant-a")) == 4
    assert tier.lookup(keys_for(tokens, salt="tenant-b")) == 0
    assert tier.lookup(keys_for(tokens)) == 0


def test_capacity_holds_and_least_recently_used_go_first(tmp_path):
    file_len = block_file.header_bytes_needed(BLOCK) + PAYLOAD
    tier = make_tier(tmp_path, capacity=6 * file_len)
    first, second = keys_for(list(range(16))), keys_for(list(range(50, 66)))
    stored(tier, first)
    assert tier.load(first[:1])  # block 0 becomes the most recently used
    stored(tier, second)
    stats = tier.stats()
    assert stats.bytes_used <= 6 * file_len and stats.num_blocks == 6
    assert stats.blocks_evicted == 2
    held = [tier.contains(k.block_hash) for k in first]
    assert held == [True, False, False, True]
    tier.check_integrity()
    files = [p for p in tmp_path.rglob("*" + block_file.SUFFIX)]
    assert len(files) == 6


def test_lru_order_survives_a_restart(tmp_path):
    file_len = block_file.header_bytes_needed(BLOCK) + PAYLOAD
    keys = keys_for(list(range(16)))
    tier = stored(make_tier(tmp_path), keys)
    tier.close()
    for age, key in zip((40, 30, 10, 20), keys):  # block 2 the oldest by its file's time
        path = block_path(tier.directory, key.block_hash)
        os.utime(path, (path.stat().st_atime, path.stat().st_mtime - age))
    tier = make_tier(tmp_path, capacity=3 * file_len)
    assert [tier.contains(k.block_hash) for k in keys] == [False, True, True, True]


def test_corrupted_truncated_and_foreign_files_are_skipped_and_removed(tmp_path):
    keys = keys_for(list(range(16)))
    tier = stored(make_tier(tmp_path), keys)
    tier.close()
    paths = [block_path(tier.directory, k.block_hash) for k in keys]
    data = paths[1].read_bytes()
    paths[1].write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # corrupted: caught when read
    paths[2].write_bytes(paths[2].read_bytes()[:-10])  # truncated: caught when indexed
    paths[3].write_bytes(b"\x80\x04\x95 definitely a pickle, never unpickled")  # foreign
    tier = make_tier(tmp_path)
    assert tier.stats().files_rejected == 2 and not paths[2].exists() and not paths[3].exists()
    assert tier.lookup(keys) == 2
    assert tier.load(keys[:2]) == [payload(0)]  # stops at the corrupted block, which goes
    assert not paths[1].exists() and tier.stats().files_rejected == 3
    assert tier.lookup(keys) == 1
    tier.check_integrity()


def test_another_fingerprint_never_reads_and_is_evicted_first(tmp_path):
    file_len = block_file.header_bytes_needed(BLOCK) + PAYLOAD
    keys = keys_for(list(range(16)))
    stored(make_tier(tmp_path, fingerprint=b"A" * 16), keys).close()
    other = make_tier(tmp_path, capacity=5 * file_len, fingerprint=b"B" * 16)
    assert other.lookup(keys) == 0
    assert other.stats().bytes_used == 4 * file_len  # the other model's files count against the capacity
    stored(other, keys_for(list(range(30, 42))))
    assert other.stats().bytes_used == 5 * file_len
    assert len(list((tmp_path / (b"A" * 16).hex()).rglob("*" + block_file.SUFFIX))) == 2
    assert other.lookup(keys_for(list(range(30, 42)))) == 3


def test_another_block_shape_is_never_indexed(tmp_path):
    keys = keys_for(list(range(16)))
    stored(make_tier(tmp_path), keys).close()
    assert make_tier(tmp_path, payload_len=PAYLOAD * 2).lookup(keys) == 0


def test_directory_is_owner_only_and_files_too(tmp_path):
    root = tmp_path / "tier"
    tier = stored(make_tier(root), keys_for(list(range(8))))
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(tier.directory.stat().st_mode) == 0o700
    for path in tier.directory.rglob("*" + block_file.SUFFIX):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def test_unusable_directory_disables_the_tier_with_one_log_line(tmp_path, caplog):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    tier = make_tier(not_a_directory / "tier")
    assert not tier.enabled
    assert sum("KV disk tier DISABLED" in r.getMessage() for r in caplog.records) == 1
    tier.store([(k, payload(0)) for k in keys_for(list(range(8)))])
    assert tier.lookup(keys_for(list(range(8)))) == 0 and tier.stats().writes_dropped == 2
    tier.close()


def test_a_failing_write_disables_the_tier_and_drops_the_rest(tmp_path, caplog, monkeypatch):
    tier = make_tier(tmp_path)
    real_open = os.open

    def full_disk(path, *args, **kwargs):
        if ".tmp-" in str(path):
            raise OSError(28, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", full_disk)
    stored(tier, keys_for(list(range(40))))
    assert not tier.enabled
    assert sum("KV disk tier DISABLED" in r.getMessage() for r in caplog.records) == 1
    assert tier.stats().writes_dropped == 10 and tier.stats().num_blocks == 0
    assert not list(tmp_path.rglob("*.tmp-*"))


def test_a_writer_far_behind_drops_instead_of_growing(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, FINGERPRINT, BLOCK, PAYLOAD, max_pending_bytes=2 * PAYLOAD)
    # One store call queues under the lock the writer needs: only two payloads fit in the queue.
    tier.store([(k, payload(i)) for i, k in enumerate(keys_for(list(range(40))))])
    tier.flush()
    stats = tier.stats()
    assert (stats.blocks_written, stats.writes_dropped) == (2, 8)


def test_integrity_check_catches_a_mislabelled_block_in_flight(tmp_path):
    tier = make_tier(tmp_path)
    good, other = keys_for(list(range(8)))
    bad = BlockKey(good.block_hash, good.parent_hash, other.token_ids)  # K/V of other tokens under good's name
    tier._pending[good.block_hash] = (bad, payload(0))
    tier._pending_bytes += PAYLOAD
    with pytest.raises(KVIntegrityError, match="does not hash to its name"):
        tier.check_integrity()


def test_integrity_check_catches_wrong_byte_accounting(tmp_path):
    tier = stored(make_tier(tmp_path), keys_for(list(range(8))))
    tier._bytes_used += 1
    with pytest.raises(KVIntegrityError, match="counter says"):
        tier.check_integrity()
