"""A compressing request's size counted ahead (ChunkPolicy.peak_slots / worst_peak_slots) against the blocks the KV
manager really holds as the request grows, chunked every way a step may cut it."""

import pytest

from kvserve.arith import cdiv
from kvserve.kv.compressed_chunks import ChunkPolicy
from kvserve.kv.manager import KVCacheManager

BS = 4


def held_peak(policy: ChunkPolicy, num_new_tokens: int, step: int) -> tuple[int, int]:
    """Grow one compressing request through its prompt (steps of at most `step` tokens, stopped where the
    scheduler stops them) and `num_new_tokens` decodes; the most blocks it held, and the blocks it holds at the end."""
    kv = KVCacheManager(num_blocks=512, block_size=BS)
    kv.set_compression("r", policy)
    done, total, peak = 0, policy.num_prompt_tokens + num_new_tokens, 0
    while done < total:
        count = policy.stop(done, min(step, policy.num_prompt_tokens - done)) if done < policy.num_prompt_tokens else 1
        assert kv.allocate_slots("r", done + count)
        kv.take_compactions("r")
        done += count
        peak = max(peak, kv.num_blocks_held("r"))
        assert kv.num_blocks_held("r") == kv.num_used_blocks  # alone in the pool: the pool's own count
    return peak, kv.num_blocks_held("r")


@pytest.mark.parametrize("prompt", [5, 19, 20, 21, 35, 36, 37, 52, 60, 67, 68, 90])
@pytest.mark.parametrize("new_tokens", [0, 1, 7])
@pytest.mark.parametrize("step", [1, 3, 16, 1000])
def test_peak_slots_is_the_most_blocks_the_manager_holds(prompt, new_tokens, step):
    policy = ChunkPolicy(16, 8, 4, prompt)
    peak, end = held_peak(policy, new_tokens, step)
    total = prompt + new_tokens
    assert cdiv(policy.peak_slots(total), BS) == peak
    assert cdiv(policy.slots(total), BS) == end
    kv = KVCacheManager(num_blocks=512, block_size=BS)
    assert kv.peak_blocks_compressed(policy, total) == peak


@pytest.mark.parametrize("new_tokens", [0, 5])
@pytest.mark.parametrize("window", [0, 4, 9])
def test_worst_peak_slots_covers_every_shorter_prompt(new_tokens, window):
    for prompt in range(1, 120):
        worst = max(ChunkPolicy(16, 8, window, n).peak_slots(n + new_tokens) for n in range(1, prompt + 1))
        assert ChunkPolicy(16, 8, window, prompt).worst_peak_slots(new_tokens) == worst, prompt


def test_one_more_prompt_token_can_need_fewer_blocks():
    # 19 tokens: no chunk compressed (it needs 16 + 4 tokens); 20: chunk 0 keeps 8, so the tail 4 -> 12 slots,
    # but chunk 0 was held whole (16) before it was compacted.
    assert ChunkPolicy(16, 8, 4, 19).peak_slots(19) == 19
    assert ChunkPolicy(16, 8, 4, 20).peak_slots(20) == 16
    assert ChunkPolicy(16, 8, 4, 20).worst_peak_slots(0) == 19
