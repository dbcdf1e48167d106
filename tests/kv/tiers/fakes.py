"""Stand-ins for a tier and the paged tensors, for tests of what surrounds them."""

from kvserve.kv.tiers.connector import KVTier


class DictTier(KVTier):
    """A tier in a dict, counting its lookups."""

    def __init__(self, name="memory"):
        self.name, self.blocks, self.lookups = name, {}, 0

    def lookup(self, keys):
        self.lookups += 1
        return next((i for i, key in enumerate(keys) if key not in self.blocks), len(keys))

    def load(self, keys):
        return [self.blocks[key] for key in keys]

    def store(self, entries):
        self.blocks.update(entries)

    def evict(self, key):
        return self.blocks.pop(key, None) is not None

    def contains(self, block_hash):
        return any(key.block_hash == block_hash for key in self.blocks)

    def disable(self, why):
        self.enabled = False

    def stats(self):
        raise AssertionError("the fake tier keeps no stats: a test that reads them needs the disk tier")

    def flush(self):
        pass

    def close(self):
        pass

    def check_integrity(self):
        pass


class BytesCache:
    """Block contents as bytes, standing in for the paged tensors."""

    def __init__(self, num_blocks):
        self.contents = [b""] * num_blocks

    def read_blocks(self, block_ids):
        return [self.contents[i] for i in block_ids]

    def write_blocks(self, block_ids, payloads):
        for block_id, payload in zip(block_ids, payloads):
            self.contents[block_id] = payload
