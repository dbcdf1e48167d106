"""The engine emits deltas (what each step added, O(1) per step) and RequestOutputAssembler rebuilds
the cumulative finals from them: text, token ids, logprobs and prompt logprobs, stop strings included."""

import dataclasses

import numpy as np
import pytest

from kvserve.engine.output.types import RequestDelta, RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from tests.engine.test_engine import BYTES_PER_TOKEN, make_engine
from tests.helpers import build_hf_model, reference_logits, run_to_finals
from tests.server.inprocess import with_tiny_tokenizer


@pytest.fixture(scope="module")
def loaded(tiny_models):
    """The tiny llama-gqa model with a character tokenizer (stop strings need text)."""
    return with_tiny_tokenizer(tiny_models("llama-gqa"))


@pytest.fixture(scope="module")
def reference():
    return build_hf_model("llama-gqa")


def test_a_long_generation_emits_only_what_each_step_added(loaded):
    engine = make_engine(loaded, speculative="off")  # one token per step (drafting: test_drafting.py)
    prompt = [40, 41, 42, 43, 44, 45]
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    engine.add_request(prompt, params)
    deltas: list[RequestDelta] = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert len(deltas) == 200  # one per decode step
    first = deltas[0]
    assert len(first.new_prompt_logprobs) == len(prompt)  # the prompt's logprobs, on the first delta
    lists = [f.name for f in dataclasses.fields(RequestDelta) if f.name != "prompt_token_ids"]
    longest_token = engine.tokenizer.longest_token_chars
    for delta in deltas:
        assert len(delta.new_token_ids) == len(delta.new_logprobs) == 1
        assert len(delta.new_text) <= longest_token
        assert delta.prompt_token_ids is first.prompt_token_ids  # the request's own list, never copied
    for delta in deltas[1:]:
        assert delta.new_prompt_logprobs == []  # never sent twice
        # Whatever fields a delta gains, none may be a list that grows with the step count.
        assert all(len(value) <= 1 for value in (getattr(delta, name) for name in lists) if isinstance(value, list))

    final = RequestOutputAssembler.assemble(deltas)
    completion = final.outputs[0]
    assert completion.token_ids == [d.new_token_ids[0] for d in deltas]
    assert completion.text == "".join(d.new_text for d in deltas) == engine.tokenizer.decode(completion.token_ids)
    assert [entry.token_id for entry in completion.logprobs] == completion.token_ids
    assert final.prompt_logprobs == first.new_prompt_logprobs and final.finished


def run(engine, prompts, params):
    """Finals in prompt order, and each request's engine state (what the finals used to be copied from)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    requests = [(engine.scheduler.requests[i], engine.outputs.tracker(i)) for i in ids]
    finals = run_to_finals(engine)
    return [finals[i] for i in ids], requests


@pytest.mark.parametrize("engine_args", [
    {}, {"max_num_batched_tokens": 5}, {"kv_cache_memory": 20 * 4 * BYTES_PER_TOKEN, "max_num_batched_tokens": 16},
], ids=["one-shot", "chunked", "preempting"])
def test_assembled_finals_are_the_whole_results(loaded, reference, engine_args):
    tokenizer = loaded.tokenizer
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 110, int(n)).tolist() for n in rng.integers(3, 24, 6)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    unstopped, _ = run(make_engine(loaded), prompts, [greedy] * len(prompts))
    # Stop strings that do occur (some span tokens); the last request has none and may end on EOS.
    stops = [[final.outputs[0].text[5:7]] for final in unstopped[:-1]] + [[]]
    params = [SamplingParams(max_tokens=24, temperature=0, stop=stop, logprobs=2, prompt_logprobs=2) for stop in stops]
    engine = make_engine(loaded, **engine_args)
    finals, requests = run(engine, prompts, params)
    if "kv_cache_memory" in engine_args:
        assert engine.stats().num_preemptions > 0  # prompt logprobs of a recomputed prompt are not sent twice

    for prompt, stop, final, (request, tracker) in zip(prompts, stops, finals, requests):
        completion = final.outputs[0]
        # What the engine holds for the request: where the cumulative outputs used to be copied from.
        assert completion.token_ids == tracker.token_ids == request.output_token_ids
        assert completion.text == tracker.text
        assert completion.finish_reason == request.finish_reason
        assert final.prompt_token_ids == prompt and final.finished and final.error is None
        whole = tokenizer.decode(completion.token_ids)
        if stop:
            assert completion.finish_reason == "stop" and completion.text == whole[: whole.index(stop[0])]
        else:
            assert completion.text == whole
        expected = reference_logits(reference, prompt + completion.token_ids).log_softmax(-1)
        assert [entry.token_id for entry in completion.logprobs] == completion.token_ids
        for i, entry in enumerate(completion.logprobs):
            assert entry.logprob == pytest.approx(expected[len(prompt) - 1 + i, entry.token_id].item(), abs=1e-4)
            assert entry.top[0][0] == entry.token_id and len(entry.top) == 2  # greedy
        assert len(final.prompt_logprobs) == len(prompt) and final.prompt_logprobs[0] is None
        for position, entry in enumerate(final.prompt_logprobs[1:], start=1):
            assert entry.token_id == prompt[position]
            assert entry.logprob == pytest.approx(expected[position - 1, prompt[position]].item(), abs=1e-4)


def test_an_abort_before_the_first_token_ends_the_stream_with_what_there_is(loaded):
    engine = make_engine(loaded, max_num_batched_tokens=4)
    prompt = list(range(10, 30))
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=5, logprobs=1, prompt_logprobs=0))
    engine.step()  # a prefill chunk: no token, so no delta
    final = RequestOutputAssembler.assemble([engine.abort(request_id)])
    assert final.outputs[0].finish_reason == "abort" and final.outputs[0].token_ids == []
    assert final.outputs[0].logprobs == [] and final.prompt_logprobs[0] is None
    assert 1 < len(final.prompt_logprobs) < len(prompt)  # the chunk's positions, as far as they got


def test_the_assembler_keeps_requests_apart_and_needs_the_last_delta(loaded):
    engine = make_engine(loaded)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in ([5, 6, 7], [50, 60])]
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assembler = RequestOutputAssembler()
    finals = [final for final in map(assembler.add, deltas) if final is not None]
    assert [final.request_id for final in finals] == ids
    assert [final.outputs[0].token_ids for final in finals] == [
        [t for d in deltas if d.request_id == request_id for t in d.new_token_ids] for request_id in ids]
    with pytest.raises(ValueError, match="before the request finished"):
        RequestOutputAssembler.assemble([d for d in deltas if d.request_id == ids[0]][:-1])
