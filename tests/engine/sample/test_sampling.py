import pytest
import torch

from kvserve.engine.sample.sampling import (SamplingParams, apply_repetition_penalty, greedy_tokens, make_generator,
                                            sample)
from kvserve.errors import InvalidRequestError


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.2), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(seed="x"), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(max_tokens=True), "max_tokens"),
    # Values the sampler's float32 arithmetic cannot survive, refused with their bound.
    (dict(repetition_penalty=1e-40), r"repetition_penalty must be in \[0.01, 100\]"),
    (dict(repetition_penalty=1e3), "repetition_penalty"),
    (dict(temperature=float("inf")), r"temperature must be >= 0 and <= 100"),
    (dict(temperature=1e39), "temperature"),
    (dict(presence_penalty=float("-inf")), "presence_penalty"),
    (dict(seed=2**64), r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
    (dict(seed=-(2**63) - 1), "seed"),
])
def test_invalid_parameters_are_rejected_by_name(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        SamplingParams(**kwargs)
    assert info.value.param == next(iter(kwargs))


def test_the_bounds_are_inclusive_and_every_accepted_seed_seeds_a_generator():
    for seed in (-(2**63), -1, 0, 2**64 - 1):
        make_generator(SamplingParams(seed=seed).seed)
    SamplingParams(repetition_penalty=0.01, temperature=100.0)
    SamplingParams(repetition_penalty=100.0, temperature=10**2)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="END").stop == ["END"]


def _logits(seed=0, vocab=50):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = _logits()
    assert sample(logits, SamplingParams(temperature=0.0), make_generator(None)) == int(logits.argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_torchs_argmax_ties_and_nan_included(dtype):
    rows = torch.randn(5, 49152, generator=torch.Generator().manual_seed(0)).to(dtype)
    rows[1, 7] = rows[1, 9000] = rows[1].max() + 1  # a tie: the first index
    rows[2, 300] = rows[2, 40000] = float("nan")  # NaN counts as the largest: the first one
    rows[3] = 0.5  # every value the same
    assert greedy_tokens(rows) == rows.argmax(dim=-1).tolist()
    assert greedy_tokens(rows)[1:4] == [7, 300, 0]
    assert greedy_tokens(rows[:, ::2]) == rows[:, ::2].argmax(dim=-1).tolist()  # strided rows


def test_same_seed_same_tokens_different_seed_differs():
    logits = _logits()
    params = SamplingParams(temperature=1.5)
    draws = lambda seed: [sample(logits, params, g) for g in [make_generator(seed)] for _ in range(30)]
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(1)
    best = int(logits.argmax())
    gen = make_generator(0)
    assert {sample(logits, SamplingParams(temperature=2.0, top_k=1), gen) for _ in range(20)} == {best}
    assert {sample(logits, SamplingParams(temperature=2.0, top_p=1e-6), gen) for _ in range(20)} == {best}


def test_top_k_restricts_to_the_k_best():
    logits = _logits(2)
    allowed = set(torch.topk(logits, 3).indices.tolist())
    gen = make_generator(0)
    drawn = {sample(logits, SamplingParams(temperature=5.0, top_k=3), gen) for _ in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = make_generator(0)
    drawn = {sample(logits, SamplingParams(temperature=1.0, top_p=0.7), gen) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.06, 0.04]))
    gen = make_generator(0)
    drawn = {sample(logits, SamplingParams(temperature=1.0, min_p=0.2), gen) for _ in range(300)}
    assert drawn == {0, 1}  # threshold 0.12


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.tensor([2.0, 1.5, -1.0])
    seen = torch.tensor([True, False, True])
    penalized = apply_repetition_penalty(logits, seen, 2.0)
    assert penalized.tolist() == [1.0, 1.5, -2.0]
    assert sample(logits, SamplingParams(temperature=0.0, repetition_penalty=2.0), make_generator(0), seen) == 1
