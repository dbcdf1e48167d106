"""A request's block hashes: computed once, extended as output tokens fill blocks."""

from kvserve.engine.request import Request
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.kv.prefix.hashing import block_hashes


def make_request(prompt, block_size=4, salt="tenant"):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    return Request("r", prompt, params, cache_salt=salt, block_size=block_size)


def test_prompt_blocks_are_hashed_at_creation_and_outputs_as_blocks_fill():
    request = make_request([1, 2, 3, 4, 5, 6])
    assert request.block_hashes.hashes == block_hashes([1, 2, 3, 4], 4, "tenant").hashes
    first = request.block_hashes.hashes[0]
    request.append_output_tokens([7])
    assert len(request.block_hashes) == 1  # 7 tokens: the second block is not full yet
    request.append_output_tokens([8])
    assert len(request.block_hashes) == 2 and request.block_hashes.hashes[0] is first  # append-only
    assert request.block_hashes.hashes == block_hashes(request.all_token_ids, 4, "tenant").hashes
    for token in (9, 10, 11, 12):
        request.append_output_tokens([token])
    assert request.block_hashes.hashes == block_hashes(list(range(1, 13)), 4, "tenant").hashes


def test_salt_is_part_of_every_hash_and_no_block_size_hashes_nothing():
    assert make_request([1, 2, 3, 4, 5], salt="a").block_hashes.hashes != \
        make_request([1, 2, 3, 4, 5], salt="b").block_hashes.hashes
    request = make_request([1, 2, 3, 4, 5], block_size=None)
    request.append_output_tokens([6])
    assert len(request.block_hashes) == 0
