"""A hybrid model's summary states both cache kinds: K/V per token for its attention layers, and the recurrent
state per request for the rest."""

from tests.toy_hybrid import toy_hybrid


def test_summary_states_both_cache_kinds():
    summary = toy_hybrid().summary()
    # Two attention layers of 2 KV heads x 8 (float32), two recurrent layers of (32 x 2 + 32) float32 values.
    assert "KV cache (float32): 2 layers x 2 KV heads x 2 (K, V) x 8 x 4 B = 256 bytes/token" in summary
    assert ("hybrid: K/V per token for 2 attention layers (above) + recurrent state per request for 2 recurrent "
            "layers (float32): 2 recurrent layers x (32 x 2 + 32) x 4 B = 768 bytes/state") in summary


def test_summary_of_a_model_whose_every_layer_attends_has_no_state_line(tiny_models):
    assert "recurrent" not in tiny_models("llama-gqa").summary()
