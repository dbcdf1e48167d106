"""The pool's blocks zeroed before first use, and ahead of it a piece at a time, never over a used block."""

import math

import torch

from kvserve.huge_pages import HUGE_PAGE
from kvserve.kv.cache.zeroing import BlockZeroing, blocks_per_page


def poisoned(num_tensors: int = 3, num_blocks: int = 40, width: int = 4) -> list[torch.Tensor]:
    """What a fresh pool may hold: anything, here NaN."""
    return [torch.full((num_blocks, 2, width), math.nan) for _ in range(num_tensors)]


def zeroed_blocks(tensor: torch.Tensor) -> int:
    """How many leading blocks of `tensor` are all zero."""
    flags = (tensor.flatten(1) == 0).all(dim=1).tolist() + [False]
    return flags.index(False)


def test_through_zeroes_a_chunk_at_least_and_nothing_past_it():
    tensors = poisoned()
    zeroing = BlockZeroing(tensors, 40, chunk_blocks=8, lookahead_blocks=16)
    zeroing.through(2)
    assert [zeroed_blocks(t) for t in tensors] == [8, 8, 8]
    assert all(t[8:].isnan().all() for t in tensors)
    zeroing.through(20)  # past the chunk: up to the block asked for
    assert zeroing.zeroed_upto == 21 and [zeroed_blocks(t) for t in tensors] == [21, 21, 21]
    zeroing.through(39)
    assert zeroing.zeroed_upto == 40 and all(zeroed_blocks(t) == 40 for t in tensors)


def test_ahead_zeroes_one_tensor_a_call_up_to_the_lookahead_past_the_used_blocks():
    tensors = poisoned()
    zeroing = BlockZeroing(tensors, 40, chunk_blocks=8, lookahead_blocks=16)
    assert zeroing.ahead() and [zeroed_blocks(t) for t in tensors] == [16, 0, 0]
    assert zeroing.ahead() and [zeroed_blocks(t) for t in tensors] == [16, 16, 0]
    assert not zeroing.ahead()  # the third tensor: the lookahead (16 blocks past none used) is done
    assert zeroing.zeroed_upto == 16 and not zeroing.ahead() and all(t[16:].isnan().all() for t in tensors)
    zeroing.through(9)  # a step uses blocks up to 9: the lookahead now reaches 26
    calls = 0
    while zeroing.ahead():
        calls += 1
    assert calls == 2 and zeroing.zeroed_upto == 26 and all(t[26:].isnan().all() for t in tensors)
    zeroing.through(39)
    while zeroing.ahead():
        pass
    assert zeroing.zeroed_upto == 40  # never past the pool


def test_a_step_that_needs_blocks_mid_piece_finishes_the_piece_first():
    tensors = poisoned()
    zeroing = BlockZeroing(tensors, 40, chunk_blocks=8, lookahead_blocks=16)
    zeroing.ahead()  # blocks [0, 16) of the first tensor only
    zeroing.through(3)
    assert zeroing.zeroed_upto == 16 and [zeroed_blocks(t) for t in tensors] == [16, 16, 16]


def test_blocks_below_the_watermark_are_never_zeroed_again():
    tensors = poisoned()
    zeroing = BlockZeroing(tensors, 40, chunk_blocks=8, lookahead_blocks=16)
    zeroing.through(5)
    for tensor in tensors:
        tensor[:6] = 7.0  # a step's K/V
    while zeroing.ahead():
        pass
    zeroing.through(30)
    while zeroing.ahead():
        pass
    assert all((t[:6] == 7).all() and (t[6:] == 0).all() for t in tensors)


def test_the_lookahead_is_a_huge_page_of_the_widest_tensor():
    narrow, wide = torch.empty(10, 64, dtype=torch.uint8), torch.empty(10, 8192, dtype=torch.uint8)
    assert blocks_per_page([narrow, wide], minimum=4) == HUGE_PAGE // 8192
    assert blocks_per_page([narrow, wide], minimum=1024) == 1024


def test_ahead_over_the_whole_pool_goes_to_its_end_a_piece_at_a_time():
    tensors = poisoned(num_blocks=40)
    zeroing = BlockZeroing(tensors, 40, chunk_blocks=8, lookahead_blocks=16)
    calls = 1
    while zeroing.ahead(whole_pool=True):
        calls += 1
    assert calls == 9 and zeroing.zeroed_upto == 40 and zeroing.used_upto == 0  # 3 pieces of 16, 16, 8 blocks
    assert all(zeroed_blocks(t) == 40 for t in tensors)
