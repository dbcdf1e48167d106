"""What each attention layer keeps in the KV cache, for the lab's pages: a model whose layers differ (Gemma 4)
stores some layers' K/V in its own shape, packed over the pool's slots, and lets others read an earlier
layer's cache; every other model stores each layer alike, and the pages say nothing more."""

from __future__ import annotations

from kvserve.config import ModelConfig
from kvserve.kv.cache.kv_spec import KVSpec


def kv_layers_info(spec: KVSpec, config: ModelConfig) -> dict | None:
    """Per attention layer (as the model numbers it): its window, and either the shape and pool slots it stores
    or the layer whose cache it reads; None where every layer stores its own alike."""
    if not spec.layer_kv:
        return None
    model_layer = config.attention_layers
    layers = []
    for layer in range(spec.num_attention_layers):
        stored = spec.stored_layer(layer)
        entry = {"layer": model_layer[layer], "window": config.window_for_layer(model_layer[layer])}
        source = config.kv_source_of(layer)
        if source != layer:
            entry["reads"] = model_layer[source]
        else:
            shape = spec.layer_kv[stored]
            entry.update(kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, k_eq_v=shape.k_eq_v,
                         slots=list(spec.slots_of(stored)), packed=spec.packed(stored) is not None)
        layers.append(entry)
    return {"layers": layers, "slots": spec.num_layers, "slot_rows": spec.num_kv_heads, "row_width": spec.head_dim,
            "padding_bytes_per_token": spec.padding_bytes_per_token()}
