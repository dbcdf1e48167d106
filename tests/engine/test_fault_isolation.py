"""One request's failure (sampling, post-processing, or a forward that fails with it) fails that request
alone: the others in the same steps finish with the outputs they get alone, and no block leaks."""

import asyncio

import pytest
import torch

from kvserve.engine.sample import acceptance as acceptance_module
from kvserve.engine.output.types import RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams, sample
from kvserve.errors import RequestFailedError
from tests.engine.test_async_engine import async_engine_for
from tests.engine.test_engine import make_engine, run_all, workload
from tests.helpers import TINY_VOCAB, run_to_finals

POISON_TOKEN = TINY_VOCAB - 1
POISON_SEED = 666


class PoisonedModel:
    """The model, except that a forward whose batch contains POISON_TOKEN raises."""

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, *args, **kwargs):
        if bool((input_ids == POISON_TOKEN).any()):
            raise RuntimeError("simulated forward failure")
        return self._model(input_ids, *args, **kwargs)


def step_all(engine) -> dict:
    """Step until idle; {request id: final output}, checking block accounting after every step."""
    finals = run_to_finals(engine)
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    return finals


def clean_prompts(prompts):
    return [[t for t in p if t != POISON_TOKEN] or [1] for p in prompts]


@pytest.fixture(scope="module")
def expected(tiny_models):
    prompts, params = workload()
    prompts = clean_prompts(prompts)
    return prompts, params, run_all(make_engine(tiny_models()), prompts, params)


def test_a_request_whose_sampling_raises_fails_alone(tiny_models, expected, monkeypatch):
    prompts, params, alone = expected

    def flaky_sample(logits, params, *args):
        if params.seed == POISON_SEED:
            raise RuntimeError("simulated sampling failure")
        return sample(logits, params, *args)

    monkeypatch.setattr(acceptance_module, "sample", flaky_sample)
    engine = make_engine(tiny_models(), block_size=4)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4])]
    culprit = engine.add_request(prompts[4], SamplingParams(max_tokens=5, temperature=1.0, seed=POISON_SEED))
    ids += [engine.add_request(p, sp) for p, sp in zip(prompts[5:], params[5:])]
    finals = step_all(engine)
    assert finals[culprit].error is not None and "simulated sampling failure" in finals[culprit].error
    assert finals[culprit].outputs[0].finish_reason == "error"
    others = [i for i in finals if i != culprit]
    assert [finals[i].outputs[0].token_ids for i in ids] == alone[:4] + alone[5:]
    assert all(finals[i].error is None for i in others)


def test_a_request_whose_forward_raises_is_found_and_fails_alone(tiny_models, expected):
    prompts, params, alone = expected
    engine = make_engine(tiny_models())
    engine.runner.model = PoisonedModel(engine.runner.model)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:3], params[:3])]
    culprit = engine.add_request([5, 9, POISON_TOKEN, 7], SamplingParams(max_tokens=4, temperature=0.0))
    ids += [engine.add_request(p, sp) for p, sp in zip(prompts[3:], params[3:])]
    finals = step_all(engine)
    assert "simulated forward failure" in finals[culprit].error
    assert [finals[i].outputs[0].token_ids for i in ids] == alone
    assert all(finals[i].error is None and finals[i].outputs[0].finish_reason == "length" for i in ids)


def test_hostile_sampling_settings_are_made_safe():
    logits = torch.randn(TINY_VOCAB, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    # top_p 1e-300 rounds to 0 in float32: the top token must survive.
    token = sample(logits, SamplingParams(top_p=1e-300, temperature=1.0), generator)
    assert token == int(logits.argmax())
    # Logits pushed to inf (e.g. by an extreme penalty) give NaN under softmax: the largest wins.
    overflowing = logits.clone()
    overflowing[7] = float("inf")
    overflowing[9] = float("nan")
    assert sample(overflowing, SamplingParams(temperature=1.0), generator) == 7


def test_the_async_engine_fails_only_the_culprits_stream(tiny_models, expected):
    prompts, params, alone = expected
    engine = make_engine(tiny_models())
    engine.runner.model = PoisonedModel(engine.runner.model)

    async def main():
        async_engine = async_engine_for(engine)
        await async_engine.start()

        async def consume(stream):
            try:
                return RequestOutputAssembler.assemble([delta async for delta in stream]).outputs[0].token_ids
            except RequestFailedError as exc:
                return exc

        streams = [async_engine.generate(p, sp, f"ok-{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        streams.insert(2, async_engine.generate([3, POISON_TOKEN], SamplingParams(max_tokens=3), "bad"))
        results = await asyncio.gather(*(consume(s) for s in streams))
        await async_engine.stop()
        return results

    results = asyncio.run(asyncio.wait_for(main(), timeout=60))
    failed = results.pop(2)
    assert isinstance(failed, RequestFailedError) and failed.request_id == "bad"
    assert results == alone
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
