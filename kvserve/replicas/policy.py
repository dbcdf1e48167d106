"""Which replica a request goes to: by what each holds of its prefix, and by load (no Ray here).

`cache_aware` (the default) follows SGLang's and vLLM's router of that name:
while the replicas are balanced, it scores each by llm-d's weighted sum of
three scorers, 3 x prefix + 2 x queue + 2 x KV free space (each in [0, 1]):

    prefix = leading blocks of the request the replica holds / the request's blocks
    queue  = 1 - load / (the largest load + 1), load = waiting + running requests
    kv     = free blocks / pool blocks

When they are not balanced — the busiest replica's load exceeds the idlest's
by more than `balance_abs_threshold` requests AND more than
`balance_rel_threshold` times — the prefix is ignored and the least loaded
replica wins (SGLang's rule: both thresholds must be crossed, defaults 32 and
1.0001 there for GPU batches of hundreds; kvserve's CPU replicas batch far
fewer requests, so 8 and 1.5 here). Ties go to a random one of the best.

`round_robin` and `pow2` (power of two choices: two random replicas, the less
loaded one) ignore the prefix, for comparison. Every policy ranks all
replicas, best first: a replica that refuses (full) passes the request on.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Sequence

POLICIES = ("cache_aware", "round_robin", "pow2")


@dataclass
class ReplicaView:
    """What the router knows of one replica."""

    replica_id: str
    waiting: int = 0
    running: int = 0
    free_blocks: int = 0
    num_blocks: int = 1
    held: set[int] = field(default_factory=set)  # external block hashes it holds (kv/events/wire.py)

    @property
    def load(self) -> int:
        return self.waiting + self.running

    def leading_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many of the request's blocks, from the first, the replica holds (a prefix hit stops at a miss)."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.held:
                break
            count += 1
        return count


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "cache_aware"
    prefix_weight: float = 3.0  # llm-d's default scorer weights: prefix 3, queue 2, KV utilization 2
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"router {self.name!r}: one of {', '.join(POLICIES)}")


class RoutingPolicy:
    def __init__(self, config: PolicyConfig | None = None, seed: int | None = None) -> None:
        self.config = config or PolicyConfig()
        self._random = random.Random(seed)
        self._turn = itertools.count()

    def rank(self, replicas: Sequence[ReplicaView], block_hashes: Sequence[int]) -> list[ReplicaView]:
        """Every replica, the preferred first."""
        if len(replicas) <= 1:
            return list(replicas)
        name = self.config.name
        if name == "round_robin":
            start = next(self._turn) % len(replicas)
            return list(replicas[start:]) + list(replicas[:start])
        if name == "pow2":
            first, second = self._random.sample(list(replicas), 2)
            best = first if first.load <= second.load else second
            return [best] + [r for r in self._by_load(replicas) if r is not best]
        if self.imbalanced(replicas) or not block_hashes:
            return self._by_load(replicas)
        scores = {r.replica_id: self.score(r, block_hashes, replicas) for r in replicas}
        shuffled = self._random.sample(list(replicas), len(replicas))  # ties: a random one of the best
        return sorted(shuffled, key=lambda r: -scores[r.replica_id])

    def score(self, replica: ReplicaView, block_hashes: Sequence[int], replicas: Sequence[ReplicaView]) -> float:
        config = self.config
        prefix = replica.leading_blocks(block_hashes) / len(block_hashes)
        queue = 1.0 - replica.load / (max(r.load for r in replicas) + 1)
        kv = replica.free_blocks / max(replica.num_blocks, 1)
        return config.prefix_weight * prefix + config.queue_weight * queue + config.kv_weight * kv

    def imbalanced(self, replicas: Sequence[ReplicaView]) -> bool:
        loads = [r.load for r in replicas]
        busiest, idlest = max(loads), min(loads)
        return (busiest - idlest > self.config.balance_abs_threshold
                and busiest > idlest * self.config.balance_rel_threshold)

    def _by_load(self, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        shuffled = self._random.sample(list(replicas), len(replicas))
        return sorted(shuffled, key=lambda r: r.load)
