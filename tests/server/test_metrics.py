"""/metrics engine gauges come from the engine's stats snapshot (in process, no HTTP server)."""

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.sampling import SamplingParams
from kvserve.server.metrics import ServerMetrics
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
