"""KV compression's blocks counted exactly (issue 43): the engine's can-it-ever-fit check sizes a compressing
request by its kept blocks, and the stats (and /v1/kv_cache) report the blocks compressing requests hold and the
tokens they dropped, as the pool itself counts them."""

import pytest

from kvserve.arith import cdiv
from kvserve.errors import InvalidRequestError
from kvserve.server.core.kv_report import kv_cache_report
from tests.engine.test_kv_compression import BS, engine_with, greedy, prompt, spec


def test_a_prompt_that_fits_only_compressed_is_admitted_and_runs(tiny_models):
    loaded = tiny_models("llama-gqa")
    engine = engine_with(loaded, spec(ratio=4.0), kv_cache_memory="64KiB")
    kv, tokens, params = engine.kv_manager, prompt(120), greedy(max_tokens=8)
    assert cdiv(len(tokens) + params.max_tokens, BS) > kv.num_blocks  # uncompressed it could never fit
    with pytest.raises(InvalidRequestError, match="KV blocks but the whole cache has"):
        engine.add_request(tokens, greedy(max_tokens=8, kv_compression="none"))
    request_id = engine.add_request(tokens, params)
    policy = engine.scheduler.requests[request_id].compression
    most_held = most_computed = 0
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        stats = engine.stats()
        if not stats.running:
            break
        entry = stats.running[0]
        assert stats.compression.num_blocks == entry.num_blocks == stats.num_used_blocks  # the pool's own count
        assert entry.num_dropped_tokens == stats.compression.num_dropped_tokens == kv.dropped_tokens(request_id)
        most_held, most_computed = max(most_held, entry.num_blocks), max(most_computed, entry.num_computed_tokens)
    assert most_held == cdiv(policy.peak_slots(most_computed), BS)
    assert most_held <= kv.peak_blocks_compressed(policy, len(tokens) + params.max_tokens) <= kv.num_blocks
    assert engine.stats().compression.num_dropped_tokens_total == policy.dropped(len(tokens))


def test_kv_cache_report_counts_compressing_requests_blocks_beside_plain_ones(tiny_models):
    engine = engine_with(tiny_models("llama-gqa"), spec(ratio=2.0))
    compressing = engine.add_request(prompt(60), greedy(max_tokens=4))
    plain = engine.add_request(prompt(40, seed=1), greedy(max_tokens=4, kv_compression="none"))
    seen = 0
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        held = {r.request_id: r for r in stats.running}
        if compressing not in held or plain not in held:
            continue
        report = kv_cache_report(engine)
        compression = report["compression"]
        assert compression["num_requests"] == 1
        assert compression["num_blocks"] == held[compressing].num_blocks
        assert compression["num_blocks"] + held[plain].num_blocks == report["num_used_blocks"]
        assert compression["num_dropped_tokens"] == held[compressing].num_dropped_tokens
        assert held[plain].num_dropped_tokens == 0
        seen += compression["num_dropped_tokens"] > 0
    assert seen  # the report was read while the compressing request held compressed chunks
    report = kv_cache_report(engine)
    assert report["compression"]["num_blocks"] == 0 and report["num_used_blocks"] == 0
    assert report["compression"]["num_dropped_tokens_total"] == report["num_compressed_tokens"] == 3 * 8


def test_no_compression_no_compression_stats(tiny_models):
    engine = engine_with(tiny_models("llama-gqa"), None)
    engine.add_request(prompt(30), greedy(max_tokens=2))
    engine.step()
    assert engine.stats().compression is None
    assert kv_cache_report(engine)["compression"] is None
