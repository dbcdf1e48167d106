"""A compressing request's prefix match below the pool (KV compression, issue 43): its slot blocks as a lower tier
stores them.

A compressed chunk's kept blocks go to a tier as they are, under their slot keys (compressed_keys.py: a kept
block's key names its chunk and its index, and chains the spec's salt), so only a request with the same prefix and
spec ever finds them there. A hit through a tier ends where a pool hit may end (after a chunk's last kept block,
or any later block), and a load that delivers part of a chunk's kept blocks counts up to the chunk before it.
"""

from __future__ import annotations

from typing import Sequence

from kvserve.kv.prefix.compressed_keys import SlotKey
from kvserve.kv.tiers.connector import BlockKey, TierConnector, TierHit


def tier_key(key: SlotKey) -> BlockKey:
    """The key a slot block is stored under in a tier."""
    return BlockKey(key.block_hash, key.parent, key.token_ids, key.extra)


def tier_hit(keys: Sequence[SlotKey], tiers: TierConnector, last_token: int) -> tuple[TierHit, SlotKey] | None:
    """Where `keys` (the slot blocks after the pool's part of a match) continue in a tier: the hit, trimmed to
    end where a hit may end and at most at token `last_token`, and its last key; None if no whole part is held."""
    usable = []
    for key in keys:
        if key.end > last_token:
            break
        usable.append(key)
    hit = tiers.lookup([tier_key(key) for key in usable])
    if hit is None:
        return None
    held = max((i + 1 for i in range(len(hit.keys)) if usable[i].complete), default=0)
    return (TierHit(hit.tier, hit.keys[:held]), usable[held - 1]) if held else None


def loaded_tokens(keys: Sequence[SlotKey], num_before: int) -> int:
    """Tokens a request holds once the blocks of `keys` (the first ones of its tier part, after `num_before`
    tokens) arrived: up to the last one a hit may end at."""
    return max((key.end for key in keys if key.complete), default=num_before)
