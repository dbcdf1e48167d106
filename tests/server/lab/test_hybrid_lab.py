"""The lab on a hybrid model (the toy hybrid, in process): its recurrent-state slots in the feed beside the
blocks, both cache kinds in /lab/api/info and the calculator, and the steps page's own small engines sized
for the state too. A model whose every layer attends has none of it."""

from __future__ import annotations

from collections import Counter

import pytest

from kvserve.arith import cdiv
from kvserve.server.lab.steps import StepsRunner
from tests.engine.test_hybrid_state import engine_for
from tests.server.inprocess import serve_in_process, with_tiny_tokenizer
from tests.toy_hybrid import toy_hybrid

SLOT_BYTES = 768  # 2 toy recurrent layers x (32 x 2 + 32) float32 values x 4 B
NUM_SLOTS = 32
KV_MEMORY = 4 * 2**20


def hybrid_options() -> dict:
    """4 MiB, of which 32 state slots (the rest K/V), snapshots every 2 blocks (of the default 16 tokens)."""
    return {"state_cache_fraction": NUM_SLOTS * SLOT_BYTES / KV_MEMORY, "state_snapshot_tokens": 32,
            "weights_dtype": "float32"}


@pytest.fixture(scope="module")
def hybrid_app():
    with serve_in_process(with_tiny_tokenizer(toy_hybrid()), kv_cache_memory=str(KV_MEMORY),
                          engine_options=hybrid_options()) as client:
        yield client


def test_info_and_feed_carry_the_state_slots(hybrid_app):
    info = hybrid_app.get("/lab/api/info").json()
    assert info["attention_layers"] == 2 and info["recurrent_state"] == {
        "layers": 2, "slot_bytes": SLOT_BYTES, "formula": "2 recurrent layers x (32 x 2 + 32) x 4 B = 768 bytes/state"}
    idle = hybrid_app.get("/lab/api/snapshot").json()["states"]
    assert (idle["slots"], idle["slot_bytes"], idle["live"], idle["snapshot_interval"]) == (NUM_SLOTS, SLOT_BYTES, 0, 2)
    assert idle["kinds"] == "f" * NUM_SLOTS
    body = {"prompt": "The capital is where the capital is, and the capital is", "max_tokens": 4, "temperature": 0}
    assert hybrid_app.post("/v1/completions", json=body).status_code == 200
    snapshot = hybrid_app.get("/lab/api/snapshot").json()
    after = snapshot["states"]
    assert snapshot["blocks"]["states"] == after  # the block view carries the slots at its own step
    kinds = Counter(after["kinds"])
    assert len(after["kinds"]) == NUM_SLOTS and set(kinds) <= set("lswf")
    assert kinds["l"] == after["live"] == 0 and kinds["s"] == after["snapshots"] > 0  # the prompt's snapshots
    assert hybrid_app.get("/v1/kv_cache").json()["recurrent_state"]["snapshots"] == after["snapshots"]


def test_the_calculator_plans_the_served_hybrid(hybrid_app):
    models = hybrid_app.get("/lab/api/models").json()["models"]
    served = models[0]
    assert (served["attention_layers"], served["recurrent_layers"]) == (2, 2)
    qwen = next(m for m in models if m["name"] == "Qwen3.5-0.8B")
    assert (qwen["attention_layers"], qwen["recurrent_layers"]) == (6, 18)
    body = hybrid_app.get("/lab/api/memory", params={"model": served["name"], "context": 64, "batch": 2}).json()
    plan, display = body["plan"], body["display"]
    assert plan["bytes_per_token"] == 2 * 2 * 2 * 8 * 2  # float16 K/V: 2 layers x 2 KV heads x (K, V) x 8 x 2 B
    assert (plan["state_bytes_per_request"], plan["state_bytes_total"]) == (SLOT_BYTES, 2 * SLOT_BYTES)
    assert plan["bytes_per_request"] == 64 * plan["bytes_per_token"] + SLOT_BYTES
    assert display["state_bytes_total"] and display["bytes_per_request"]


def test_a_model_without_recurrent_layers_has_no_state_in_the_lab(lab_app):
    assert lab_app.get("/lab/api/info").json()["recurrent_state"] is None
    assert lab_app.get("/lab/api/snapshot").json()["states"] is None
    served = lab_app.get("/lab/api/models").json()["models"][0]
    assert served["recurrent_layers"] == 0


def test_the_steps_engines_hold_the_whole_run_and_its_states():
    # The serving engine gives states a large share; the lab's small pools still hold the whole run's K/V.
    serving = engine_for(toy_hybrid())
    engines = StepsRunner(serving)._get_engines()
    limits = StepsRunner(serving).limits
    tokens = limits.max_prompt_tokens + limits.max_new_tokens
    for engine in engines.values():
        assert engine.kv_manager.num_blocks >= cdiv(tokens, serving.config.block_size) + 1
        assert engine.stats().states.num_slots >= 2
