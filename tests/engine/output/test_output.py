"""Stop conditions and streaming text of one request (real tokenizer, scripted tokens)."""

import pytest

from kvserve.engine.output.types import RequestMetrics
from kvserve.engine.output.processor import OutputTracker
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError


def run(tokenizer, text: str, **params):
    tracker = OutputTracker(SamplingParams(**params), tokenizer)
    streamed = []
    for token_id in tokenizer.encode(text):
        tracker.append(token_id)
        streamed.append(tracker.take_delta())
        if tracker.finished:
            break
    return tracker, "".join(streamed)


def test_stop_string_spanning_tokens_is_found_and_not_emitted(embedded_tokenizer):
    text = "The answer is forty-two. THE END and more text"
    assert len(embedded_tokenizer.encode(" THE END")) > 1  # the stop string spans tokens
    tracker, streamed = run(embedded_tokenizer, text, stop=["THE END"], max_tokens=100)
    assert tracker.finish_reason == "stop"
    assert tracker.text == "The answer is forty-two. "
    assert streamed == tracker.text  # nothing of the stop string leaked into the stream


def test_earliest_of_several_stop_strings_wins(embedded_tokenizer):
    tracker, _ = run(embedded_tokenizer, "alpha beta gamma delta", stop=["delta", "beta"], max_tokens=100)
    assert tracker.text == "alpha "


def test_stream_holds_back_a_possible_stop_prefix(embedded_tokenizer):
    tracker = OutputTracker(SamplingParams(stop=["STOP!"], max_tokens=100), embedded_tokenizer)
    for token_id in embedded_tokenizer.encode("hello ST"):
        tracker.append(token_id)
    # "ST" could begin "STOP!", and up to 4 characters are withheld while running.
    assert not tracker.take_delta().endswith("ST")


def test_max_tokens_finishes_with_length(embedded_tokenizer):
    tracker, streamed = run(embedded_tokenizer, "one two three four five six", max_tokens=3)
    assert tracker.finish_reason == "length"
    assert len(tracker.token_ids) == 3
    assert streamed == embedded_tokenizer.decode(tracker.token_ids)


def test_eos_stops_unless_ignored(embedded_tokenizer):
    eos = embedded_tokenizer.eos_token_id
    tracker = OutputTracker(SamplingParams(max_tokens=10), embedded_tokenizer)
    assert tracker.append(eos) == "stop"
    tracker = OutputTracker(SamplingParams(max_tokens=10, ignore_eos=True), embedded_tokenizer)
    assert tracker.append(eos) is None


def test_stop_token_ids(embedded_tokenizer):
    ids = embedded_tokenizer.encode("red green blue")
    tracker = OutputTracker(SamplingParams(max_tokens=10, stop_token_ids=[ids[1]]), embedded_tokenizer)
    tracker.append(ids[0])
    assert tracker.append(ids[1]) == "stop"
    assert tracker.text == "red"


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        OutputTracker(SamplingParams(stop=["x"]), None)


def test_metrics():
    metrics = RequestMetrics(arrival_time=0.0)
    assert metrics.ttft is None and metrics.tpot is None
    metrics.record_token()
    metrics.record_token()
    assert metrics.ttft > 0 and metrics.tpot >= 0 and metrics.num_output_tokens == 2
