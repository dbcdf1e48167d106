"""One disk tier directory shared by two processes (replicas on one host): one writer per block, every
block readable by both, checksums on read, a fresh temporary never taken for a crashed write."""

import multiprocessing
import os
import time

from kvserve.kv.prefix.hashing import block_hashes
from kvserve.kv.tiers import block_file
from kvserve.kv.tiers.connector import BlockKey
from kvserve.kv.tiers.disk import DiskTier
from kvserve.kv.tiers.disk_files import STALE_TEMPORARY_S, block_path, write_atomically

BLOCK = 4
PAYLOAD = 4096
FINGERPRINT = bytes(range(16))
TOKENS = list(range(1, 1 + 40 * BLOCK))  # one chain of 40 blocks


def chain_keys():
    chain = block_hashes(TOKENS, BLOCK)
    return [BlockKey(chain.hashes[i], chain.parent(i), tuple(TOKENS[i * BLOCK : (i + 1) * BLOCK]))
            for i in range(len(chain))]


def payload_of(key: BlockKey) -> bytes:
    """What every process writes for `key` (replicas compute the same K/V for the same tokens)."""
    return (key.block_hash * (PAYLOAD // 16 + 1))[:PAYLOAD]


def replica(root: str, first: int, last: int, barrier, results) -> None:
    """Write blocks [first, last) of the chain at the same moment as the other replica, then read them all."""
    tier = DiskTier(root, 1 << 30, FINGERPRINT, BLOCK, PAYLOAD)
    keys = chain_keys()
    barrier.wait()
    tier.store([(key, payload_of(key)) for key in keys[first:last]])
    tier.flush()
    barrier.wait()  # both are done writing
    held = tier.lookup(keys)
    loaded = tier.load(keys[:held])
    results.put((first, tier.stats().blocks_written, held,
                 all(bytes(p) == payload_of(k) for k, p in zip(keys, loaded)) and len(loaded) == held))
    tier.close()


def test_two_processes_write_one_directory_once_per_block_and_both_read_every_block(tmp_path):
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    # Overlapping ranges: blocks 10-29 are stored by both at once.
    workers = [context.Process(target=replica, args=(str(tmp_path), first, last, barrier, results))
               for first, last in ((0, 30), (10, 40))]
    for worker in workers:
        worker.start()
    outcome = sorted(results.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0
    assert [held for _, _, held, _ in outcome] == [40, 40]  # each reads the other's blocks too
    assert all(same for *_, same in outcome)
    assert sum(written for _, written, _, _ in outcome) == 40  # one writer per block, never two
    files = list(tmp_path.rglob("*" + block_file.SUFFIX))
    assert len(files) == 40 and not list(tmp_path.rglob("*.tmp-*"))


def test_a_corrupted_file_written_by_another_process_is_caught_on_read(tmp_path):
    keys = chain_keys()[:3]
    writer = DiskTier(tmp_path, 1 << 30, FINGERPRINT, BLOCK, PAYLOAD)
    writer.store([(key, payload_of(key)) for key in keys])
    writer.flush()
    reader = DiskTier(tmp_path, 1 << 30, FINGERPRINT, BLOCK, PAYLOAD)  # indexes the files at startup
    path = block_path(reader.directory, keys[1].block_hash)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # one flipped bit in the K/V
    path.write_bytes(bytes(data))
    assert reader.lookup(keys) == 3
    loaded = reader.load(keys)
    assert len(loaded) == 1 and bytes(loaded[0]) == payload_of(keys[0])  # stops at the bad block
    assert reader.stats().files_rejected == 1 and not path.exists()
    writer.close()
    reader.close()


def test_a_block_being_written_elsewhere_is_left_to_its_writer_and_a_dead_writers_is_taken_over(tmp_path):
    key = chain_keys()[0]
    path = block_path(tmp_path, key.block_hash)
    path.parent.mkdir(parents=True)
    temporary = path.with_name(path.name + ".tmp-writing")
    temporary.write_bytes(b"half")  # another process is writing this block now
    header = block_file.encode_header(FINGERPRINT, key, payload_of(key))
    assert not write_atomically(path, header, payload_of(key)) and not path.exists() and temporary.exists()
    old = time.time() - STALE_TEMPORARY_S - 1
    os.utime(temporary, (old, old))  # ... and died long ago
    assert write_atomically(path, header, payload_of(key)) and not temporary.exists()
    assert not write_atomically(path, header, payload_of(key))  # written: never rewritten
    # A replica's startup scan removes a dead writer's temporary, never a live one's.
    tier_dir = tmp_path / "tier"
    tier = DiskTier(tier_dir, 1 << 30, FINGERPRINT, BLOCK, PAYLOAD)
    tier.close()
    live = block_path(tier.directory, key.block_hash).with_name("x.kvblock.tmp-writing")
    dead = live.with_name("y.kvblock.tmp-writing")
    live.parent.mkdir(parents=True, exist_ok=True)
    live.write_bytes(b"")
    dead.write_bytes(b"")
    os.utime(dead, (old, old))
    DiskTier(tier_dir, 1 << 30, FINGERPRINT, BLOCK, PAYLOAD).close()
    assert live.exists() and not dead.exists()
