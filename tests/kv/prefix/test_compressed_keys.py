"""Position keys of a compressing request (kv/prefix/compressed_keys.py): the token chain's hashes while the
compressed chunks before a block follow from its position, keys that say how many chunks were compressed past."""

from kvserve.kv.compressed_chunks import ChunkPolicy
from kvserve.kv.prefix.compressed_keys import PositionKeys
from kvserve.kv.prefix.hashing import block_hashes

BS = 4


def test_position_keys_follow_the_chain_until_the_chunk_count_depends_on_the_prompt():
    tokens = list(range(100))
    chain = block_hashes(tokens, BS, salt="spec")
    three = PositionKeys(ChunkPolicy(16, 8, 4, 60), chain)  # 3 compressed chunks: blocks 0..15 by position
    two = PositionKeys(ChunkPolicy(16, 8, 4, 40), chain)  # 2 compressed chunks: blocks 0..11 by position
    assert len(three) == len(chain) == 25
    assert three[:16] == chain.hashes[:16] and two[:12] == chain.hashes[:12]
    assert all(three[i] != chain.hashes[i] for i in range(16, 25))
    # Past 48 tokens a block of the 2-chunk prompt was computed over 2 compressed chunks, the other's over 3.
    assert all(two[i] != three[i] for i in range(12, 25))
    assert three.parent(0) == chain.root and three.parent(16) == three[15] and three[-1] == three[24]
