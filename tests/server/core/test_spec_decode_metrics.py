"""/metrics has vLLM's spec-decode counters and an acceptance-length histogram; the request log line says
how many drafts a request had accepted."""

import logging

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.server.core.metrics import ServerMetrics, log_request
from tests.engine.test_engine import make_engine
from tests.server.core.test_metrics import scrape


def test_spec_decode_counters_histogram_and_log_line(tiny_models, caplog):
    engine = make_engine(tiny_models("llama-gqa"), speculative="ngram")
    metrics = ServerMetrics(AsyncEngine(engine), "tiny")
    phrase = [11, 12, 13, 14, 15, 16]
    engine.add_request(phrase * 5, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    with caplog.at_level(logging.INFO, logger="kvserve.requests"):
        while engine.has_unfinished():
            for delta in engine.step():
                log_request(delta)
    spec, samples = engine.stats().spec_decode, scrape(metrics)
    assert spec.num_drafts > 0
    assert samples["kvserve:spec_decode_num_drafts_total"] == spec.num_drafts
    assert samples["kvserve:spec_decode_num_draft_tokens_total"] == spec.num_draft_tokens
    assert samples["kvserve:spec_decode_num_accepted_tokens_total"] == spec.num_accepted_tokens
    assert samples["kvserve:spec_decode_acceptance_length_count"] == spec.num_drafts
    assert samples["kvserve:spec_decode_acceptance_length_sum"] == spec.num_accepted_tokens
    assert f"drafts {spec.num_accepted_tokens}/{spec.num_draft_tokens} accepted" in caplog.text


def test_no_spec_decode_metrics_when_it_is_off(tiny_models):
    metrics = ServerMetrics(AsyncEngine(make_engine(tiny_models("llama-gqa"), speculative="off")), "tiny")
    assert not any(name.startswith("kvserve:spec_decode") for name in scrape(metrics))


def _counter(client, name: str) -> float:
    text = client.get("/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_usage_reports_a_requests_accepted_and_rejected_drafts(tiny_app):
    """OpenAI's predicted-output fields carry a request's drafts: what it accepted and what it rejected."""
    drafts_before = _counter(tiny_app, "kvserve:spec_decode_num_draft_tokens_total")
    accepted_before = _counter(tiny_app, "kvserve:spec_decode_num_accepted_tokens_total")
    body = {"prompt": "abcd abcd abcd abcd abcd abcd abcd", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    response = tiny_app.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    details = response.json()["usage"]["completion_tokens_details"]  # prompt lookup drafts from the repeats
    drafted = _counter(tiny_app, "kvserve:spec_decode_num_draft_tokens_total") - drafts_before
    accepted = _counter(tiny_app, "kvserve:spec_decode_num_accepted_tokens_total") - accepted_before
    assert drafted > 0
    assert details == {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": drafted - accepted}
