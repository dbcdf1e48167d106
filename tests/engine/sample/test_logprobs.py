"""Log-probabilities through the engine against transformers' logits, and the OpenAI penalties."""

import pytest
import torch

from kvserve.engine.sample.sampling import SamplingParams, sample
from kvserve.errors import InvalidRequestError
from tests.engine.test_engine import make_engine, run_all
from tests.engine.test_prefix_caching import finish
from tests.helpers import build_hf_model, reference_logits

PROMPT = [5, 17, 33, 2, 90, 41, 7, 7, 120, 64, 3, 150, 11]


@pytest.fixture(scope="module")
def reference():
    return build_hf_model("llama-gqa")


@pytest.mark.parametrize("budget", [2048, 5])  # one-shot prefill and 5-token chunks
def test_prompt_logprobs_match_reference(tiny_models, reference, budget):
    engine = make_engine(tiny_models("llama-gqa"), max_num_batched_tokens=budget)
    out = finish(engine, PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))
    expected = reference_logits(reference, PROMPT).log_softmax(-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(PROMPT)
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry.token_id == PROMPT[position]
        assert entry.logprob == pytest.approx(expected[position - 1, PROMPT[position]].item(), abs=1e-4)
        top_ids = [t for t, _ in entry.top]
        assert top_ids == expected[position - 1].topk(3).indices.tolist()


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"))
    finish(engine, PROMPT, SamplingParams(max_tokens=1, temperature=0))  # fills the cache
    out = finish(engine, PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    assert out.num_cached_tokens == 0
    assert all(entry is not None for entry in out.prompt_logprobs[1:])


def test_sampled_token_logprobs_match_reference(tiny_models, reference):
    engine = make_engine(tiny_models("llama-gqa"))
    out = finish(engine, PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))
    completion = out.outputs[0]
    assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
    expected = reference_logits(reference, PROMPT + completion.token_ids).log_softmax(-1)
    for i, entry in enumerate(completion.logprobs):
        row = expected[len(PROMPT) - 1 + i]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        assert entry.top[0][0] == entry.token_id  # greedy picks the most likely token
        assert len(entry.top) == 2


def test_logprobs_do_not_change_the_tokens(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"))
    plain = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    with_logprobs = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True, logprobs=5,
                                   prompt_logprobs=1)
    assert run_all(engine, [PROMPT], [plain]) == run_all(engine, [PROMPT], [with_logprobs])


@pytest.mark.parametrize("field,value", [("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 1.5),
                                         ("presence_penalty", 2.5), ("frequency_penalty", -3)])
def test_out_of_range_values_are_rejected(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_frequency_and_presence_penalties_subtract_per_occurrence():
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0])
    counts = torch.tensor([2.0, 0.0, 0.0, 1.0])
    generator = torch.Generator().manual_seed(0)
    assert sample(logits, SamplingParams(temperature=0), generator, output_counts=counts) == 0
    # 3.0 - 2 x 0.1 = 2.8 < 2.9
    assert sample(logits, SamplingParams(temperature=0, frequency_penalty=0.1), generator, output_counts=counts) == 1
    # presence counts once: 3.0 - 0.05 = 2.95 > 2.9
    assert sample(logits, SamplingParams(temperature=0, presence_penalty=0.05), generator, output_counts=counts) == 0
    assert sample(logits, SamplingParams(temperature=0, presence_penalty=0.2), generator, output_counts=counts) == 1


def test_penalties_change_a_repetitive_greedy_output(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"))
    base = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    penalized = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, frequency_penalty=2.0)
    plain_tokens, penalized_tokens = run_all(engine, [PROMPT, PROMPT], [base, penalized])
    assert len(set(penalized_tokens)) > len(set(plain_tokens))
