"""A hybrid model's recurrent-state slots on /metrics and in /v1/kv_cache, read from the engine's stats snapshot;
a model whose every layer attends has neither."""

from collections import Counter

import pytest

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.server.core.kv_report import kv_cache_report, tenant_view
from kvserve.server.core.metrics import ServerMetrics
from kvserve.server.core.pin_owners import PinOwners
from tests.engine.test_engine import make_engine
from tests.engine.test_hybrid_state import engine_for, workload
from tests.toy_hybrid import toy_hybrid

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def state_samples(metrics: ServerMetrics) -> dict[str, float]:
    """`kvserve:state_*` samples, the slots by kind keyed as 'kvserve:state_slots/<kind>'."""
    samples = {}
    for line in metrics.render().decode().splitlines():
        if not line.startswith("kvserve:state_"):
            continue
        name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
        if 'kind="' in line:
            name += "/" + line.split('kind="', 1)[1].split('"', 1)[0]
        samples[name] = value
    return samples


@pytest.fixture(scope="module")
def toy():
    return toy_hybrid()


def test_state_slots_by_kind_size_and_evictions(toy):
    engine = engine_for(toy, state_slots=6)  # few slots: later requests evict earlier snapshots
    metrics = ServerMetrics(AsyncEngine(engine), "toy")
    for prompt in workload():
        engine.add_request(prompt, PARAMS)
    engine.step()
    states, samples = engine.stats().states, state_samples(metrics)
    kinds = Counter(states.slot_kinds)
    assert samples["kvserve:state_slots/live"] == kinds["live"] == states.num_live >= 1
    for kind in ("snapshot", "working", "free"):
        assert samples[f"kvserve:state_slots/{kind}"] == kinds[kind]
    assert sum(samples[f"kvserve:state_slots/{k}"] for k in ("live", "snapshot", "working", "free")) == 6
    assert samples["kvserve:state_slots_total"] == 6
    assert samples["kvserve:state_slot_bytes"] == 768  # 2 toy recurrent layers x (32 x 2 + 32) x 4 B
    while engine.has_unfinished():
        engine.step()
    samples = state_samples(metrics)
    assert samples["kvserve:state_slots/live"] == 0
    assert samples["kvserve:state_snapshots_evicted_total"] == engine.stats().states.num_evicted > 0


def test_kv_cache_report_has_a_recurrent_state_section(toy):
    engine = engine_for(toy)
    for prompt in workload():
        engine.add_request(prompt, PARAMS)
    engine.step()
    running = kv_cache_report(engine)["recurrent_state"]
    assert running["live"] == engine.stats().num_running >= 1
    assert (running["slots"], running["slot_bytes"], running["snapshot_interval"]) == (64, 768, 2)
    assert running["formula"] == "2 recurrent layers x (32 x 2 + 32) x 4 B = 768 bytes/state"
    while engine.has_unfinished():
        engine.step()
    done = kv_cache_report(engine)
    assert done["recurrent_state"]["live"] == 0 and done["recurrent_state"]["snapshots"] > 0
    assert done["integrity"] == "ok"
    view = tenant_view(done, "someone", PinOwners(block_size=4))
    assert view["recurrent_state"]["slots"] == 64 and "evicted" not in view["recurrent_state"]


def test_a_model_without_recurrent_layers_reports_no_state(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"))
    assert kv_cache_report(engine)["recurrent_state"] is None
    assert state_samples(ServerMetrics(AsyncEngine(engine), "tiny")) == {}
