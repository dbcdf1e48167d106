"""/metrics engine gauges come from the engine's stats snapshot (in process, no HTTP server)."""

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.server.core.metrics import ServerMetrics
from tests.engine.test_engine import make_engine


def scrape(metrics: ServerMetrics) -> dict[str, float]:
    samples = {}
    for line in metrics.render().decode().splitlines():
        if line.startswith("kvserve:") and "{" in line:
            samples[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return samples


def test_engine_gauges_follow_the_snapshot(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"))
    metrics = ServerMetrics(AsyncEngine(engine), "tiny")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for offset in (0, 50, 0):
        engine.add_request(list(range(1 + offset, 14 + offset)), params)
    assert scrape(metrics)["kvserve:num_requests_waiting"] == 3
    engine.step()
    stats, samples = engine.stats(), scrape(metrics)
    assert samples["kvserve:num_requests_running"] == stats.num_running == 2  # the twin waits for the first's blocks (FCFS: last in line)
    assert samples["kvserve:num_requests_waiting"] == 1
    assert samples["kvserve:kv_cache_blocks_used"] == stats.num_used_blocks == 8
    assert samples["kvserve:kv_cache_blocks_total"] == stats.num_blocks
    assert samples["kvserve:kv_cache_usage_perc"] == stats.num_used_blocks / stats.num_blocks
    while engine.has_unfinished():
        engine.step()
    samples = scrape(metrics)
    assert samples["kvserve:kv_cache_blocks_used"] == 0 and samples["kvserve:num_requests_running"] == 0
    assert samples["kvserve:prefix_cache_hits_total"] == 12 and samples["kvserve:prefix_cache_queries_total"] == 39
    assert samples["kvserve:kv_cache_blocks_cached"] == engine.stats().num_cached_blocks > 0


def test_disk_tier_metrics_and_the_request_log_line(tiny_models, tmp_path, caplog):
    import logging

    from kvserve.engine.output.types import RequestOutputAssembler
    from kvserve.server.core.metrics import log_request

    loaded = tiny_models("llama-gqa")
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, 35))
    writer = make_engine(loaded, kv_disk_path=str(tmp_path))
    writer.add_request(prompt, params)
    while writer.has_unfinished():
        writer.step()
    writer.close()
    engine = make_engine(loaded, kv_disk_path=str(tmp_path))
    metrics = ServerMetrics(AsyncEngine(engine), "tiny")
    samples = scrape(metrics)
    assert samples["kvserve:kv_tier_blocks"] == 8  # 35 computed tokens and samples["kvserve:kv_tier_enabled"] == 1
    assert samples["kvserve:kv_tier_hits_tokens_total"] == 0
    engine.add_request(prompt, params)
    assembler, final = RequestOutputAssembler(), None
    with caplog.at_level(logging.INFO, logger="kvserve.requests"):
        while engine.has_unfinished():
            for delta in engine.step():
                log_request(delta)
                final = assembler.add(delta) or final
    samples = scrape(metrics)
    assert samples["kvserve:kv_tier_hits_tokens_total"] == 32 == samples["kvserve:kv_tier_queries_tokens_total"]
    assert samples["kvserve:kv_tier_blocks_read_total"] == 8
    assert samples["kvserve:kv_tier_load_seconds_count"] == 1
    assert samples["kvserve:kv_tier_used_bytes"] > 0 and samples["kvserve:kv_tier_files_rejected_total"] == 0
    assert final.num_cached_tokens == 32
    assert "(32 cached: 0 from the pool, 32 from disk)" in caplog.text


def test_structured_output_counters_come_from_the_snapshot(tiny_models):
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import Engine
    from kvserve.errors import InvalidRequestError
    from kvserve.structured.params import StructuredOutputsParams
    from tests.helpers import run_to_finals
    from tests.server.inprocess import with_tiny_tokenizer

    engine = Engine(EngineConfig(kv_cache_memory=512 * 4 * 3 * 2 * 2 * 16 * 4, block_size=4),
                    loaded=with_tiny_tokenizer(tiny_models("llama-gqa")))
    metrics = ServerMetrics(AsyncEngine(engine), "tiny")
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer"], "additionalProperties": False}
    params = SamplingParams(max_tokens=30, structured_outputs=StructuredOutputsParams(json=schema))
    for _ in range(2):  # the second finds the grammar compiled
        engine.add_request("Some JSON: ", params)
    engine.add_request("Free text: ", SamplingParams(max_tokens=3))  # (not constrained)
    outputs = run_to_finals(engine)
    loop = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    try:
        engine.validate_request([1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(json=loop)))
    except InvalidRequestError:
        pass
    engine.step()  # (an idle step takes a snapshot)
    samples, stats = scrape(metrics), engine.stats().structured
    assert samples["kvserve:grammar_compiles_total"] == stats.grammar_compiles == 2  # the schema, the $ref loop
    assert samples["kvserve:grammar_compile_cache_hits_total"] == stats.compile_cache_hits >= 1
    assert samples["kvserve:grammar_compile_seconds_total"] == stats.compile_seconds > 0
    assert samples["kvserve:grammar_errors_total"] == stats.grammar_errors == 1
    assert samples["kvserve:constrained_requests_total"] == stats.constrained_requests == 2
    # `{"answer": ` is fixed by the schema: forced, never sampled, in both outputs
    assert samples["kvserve:forced_tokens_total"] == stats.forced_tokens >= 2 * len('{"answer": ')
    assert sum(o.outputs[0].text.startswith('{"answer": ') for o in outputs.values()) == 2


def test_tool_calls_parsed_is_a_counter_the_apis_feed(tiny_models):
    from tests.engine.test_engine import make_engine as plain_engine

    metrics = ServerMetrics(AsyncEngine(plain_engine(tiny_models("llama-gqa"))), "tiny")
    assert "kvserve:tool_calls_parsed_total" not in scrape(metrics)  # (no sample before the first call)
    metrics.count_tool_calls(2)
    metrics.count_tool_calls(0)
    assert scrape(metrics)["kvserve:tool_calls_parsed_total"] == 2
