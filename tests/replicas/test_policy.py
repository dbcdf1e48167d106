"""The routing policy alone: prefix first while balanced, load when not, round-robin and pow2 for comparison."""

import pytest

from kvserve.replicas.policy import PolicyConfig, ReplicaView, RoutingPolicy

PROMPT = [11, 12, 13, 14]


def views(**held):
    return [ReplicaView(name, free_blocks=50, num_blocks=100, held=set(blocks)) for name, blocks in held.items()]


def test_the_replica_holding_the_longest_leading_run_wins():
    replicas = views(a=[11], b=[11, 12, 13], c=[12, 13, 14])  # c holds blocks, but not from the first
    assert RoutingPolicy(seed=0).rank(replicas, PROMPT)[0].replica_id == "b"
    assert [r.leading_blocks(PROMPT) for r in replicas] == [1, 3, 0]


def test_load_and_free_blocks_break_a_tie_and_a_new_prefix_goes_to_the_idlest():
    a, b = views(a=[], b=[])
    a.running, b.running = 3, 1
    assert RoutingPolicy(seed=0).rank([a, b], PROMPT)[0] is b
    a.running = b.running = 1
    a.free_blocks = 90
    assert RoutingPolicy(seed=0).rank([a, b], PROMPT)[0] is a


def test_a_cached_replica_wins_over_an_idle_one_until_the_thresholds_are_crossed():
    cached, idle = views(cached=PROMPT, idle=[])
    cached.running = 4  # |4 - 0| <= 8: balanced, the prefix counts
    assert RoutingPolicy(seed=0).rank([cached, idle], PROMPT)[0] is cached
    cached.running, cached.waiting = 8, 4  # 12 - 0 > 8 and 12 > 0 x 1.5: imbalanced, the least loaded
    assert RoutingPolicy(seed=0).rank([cached, idle], PROMPT)[0] is idle
    idle.running = 10  # 12 vs 10: within both thresholds again
    assert RoutingPolicy(seed=0).rank([cached, idle], PROMPT)[0] is cached


def test_round_robin_cycles_and_pow2_picks_the_less_loaded_of_two():
    replicas = views(a=PROMPT, b=[], c=[])
    policy = RoutingPolicy(PolicyConfig("round_robin"))
    assert [policy.rank(replicas, PROMPT)[0].replica_id for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    replicas[0].running, replicas[1].running, replicas[2].running = 5, 0, 0
    pow2 = RoutingPolicy(PolicyConfig("pow2"), seed=1)
    assert all(pow2.rank(replicas, PROMPT)[0].replica_id != "a" for _ in range(20))  # a loses every pair it is in
    assert sorted(r.replica_id for r in pow2.rank(replicas, PROMPT)) == ["a", "b", "c"]  # everyone ranked


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="cache_aware, round_robin, pow2"):
        PolicyConfig("random")
