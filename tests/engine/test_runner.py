"""The runner lays the batch out in its attention backend's order; the tokens do not depend on that order."""

import random

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.kv.attention import CpuAttentionBackend
from kvserve.kv.attention.registry import ATTENTION_BACKENDS
from tests.helpers import run_to_finals


class Recording(CpuAttentionBackend):
    """The cpu backend, noting each step's scheduled new-token counts and the slices it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduled: list[list[int]] = []
        self.batches: list[list[int]] = []

    def batch_order(self, num_new_tokens):
        self.scheduled.append(list(num_new_tokens))
        return super().batch_order(num_new_tokens)

    def build_context(self, cache, slices):
        self.batches.append([s.num_new_tokens for s in slices])
        return super().build_context(cache, slices)


class Reversed(CpuAttentionBackend):
    def batch_order(self, num_new_tokens):
        return super().batch_order(num_new_tokens)[::-1]  # prefill chunks first, decodes last


class Shuffled(CpuAttentionBackend):
    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(0)

    def batch_order(self, num_new_tokens):
        order = list(range(len(num_new_tokens)))
        self.rng.shuffle(order)
        return order


def run(loaded, backend: str) -> tuple[Engine, list[list[int]]]:
    # A long prompt prefilled in chunks while shorter ones (one of a single token) are admitted
    # and decode: steps mix decodes and prefill chunks in every order.
    prompts = [list(range(10, 40)), [77], list(range(50, 60)), [3, 4], list(range(90, 110))]
    engine = Engine(EngineConfig(kv_cache_memory="4MiB", block_size=4, max_num_batched_tokens=9,
                                 attention_backend=backend), loaded=loaded)
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in prompts]
    finals = run_to_finals(engine)
    return engine, [finals[i].outputs[0].token_ids for i in ids]


def test_any_batch_order_gives_the_same_tokens_and_the_runner_applies_the_backends(tiny_models, monkeypatch):
    loaded = tiny_models("llama-gqa")
    for backend in (Recording, Reversed, Shuffled):
        monkeypatch.setitem(ATTENTION_BACKENDS, backend.__name__, backend)
    _, expected = run(loaded, "cpu")
    engine, recorded = run(loaded, "Recording")
    assert recorded == expected
    backend = engine.runner.attention
    # The scheduler's order put a single-token request after a longer one at least once ...
    assert any(counts != sorted(counts, key=lambda n: n > 1) for counts in backend.scheduled)
    # ... and the runner always handed the backend its own order: decodes first.
    assert all(batch == sorted(batch, key=lambda n: n > 1) for batch in backend.batches)
    assert run(loaded, "Reversed")[1] == expected
    assert run(loaded, "Shuffled")[1] == expected


def test_a_context_shift_moves_packed_and_slot_sharing_layers_each_in_its_own_shape():
    """The runner moves a shift's rows slot by slot: a plain layer's keys re-rotated by the model, a packed
    layer's unpacked to its heads, re-rotated and packed back, a K = V layer's values moved as they are (its
    keys are derived where they are read), and layers sharing a slot each in its own rows."""
    from types import SimpleNamespace

    import torch

    from kvserve.engine.runner import ModelRunner
    from kvserve.kv.cache.kv_spec import kv_spec
    from kvserve.kv.cache.packing import unpack_tokens
    from kvserve.kv.context_shift import ShiftPlan, TokenMoves
    from dataclasses import replace

    from tests.kv.attention.test_cpu_packed import SHARING

    spec = kv_spec(replace(SHARING, layer_windows=None), "float32")  # a shift runs on full attention only
    backend = CpuAttentionBackend()
    cache = backend.allocate_kv_cache(spec, 8, 4)
    cache.initialize_blocks_through(7)
    for slot in range(spec.num_layers):  # every row of blocks 0 and 1 something to move
        rows = torch.randn(8 * spec.num_kv_heads, spec.head_dim, generator=torch.Generator().manual_seed(slot))
        cache.write(slot, torch.arange(8 * spec.num_kv_heads), rows.view(8, spec.num_kv_heads, -1), -rows.view(8, spec.num_kv_heads, -1))
    shifted_by = []
    model = SimpleNamespace(layer_windows=spec.attention_layer_windows, has_recurrent_state=False,
                            config=SimpleNamespace(vocab_size=32),
                            shift_key_positions=lambda layer, keys, delta: shifted_by.append(layer) or keys + delta)
    runner = ModelRunner(model, cache, backend)

    def natural(layer, block, rows):
        slots = spec.slots_of(layer)
        used = spec.rows_of(layer)
        flat = backend.token_slots(cache, torch.tensor([block] * len(rows)), torch.tensor(rows))
        parts = [cache.read_rows(slot, flat) for slot in slots]
        k = torch.cat([p[0][:, used.start:used.stop] for p in parts], dim=1)
        v = torch.cat([p[1][:, used.start:used.stop] for p in parts], dim=1)
        packed = spec.packed(layer)
        return (k, v) if packed is None else unpack_tokens(packed, spec.head_dim, k, v)

    before = [natural(layer, 0, [2, 3]) for layer in range(spec.num_stored_layers)]
    runner.apply_shift(ShiftPlan(2, TokenMoves((), (), (), ()), TokenMoves((0, 0), (2, 3), (1, 1), (0, 1))))
    for layer, (k, v) in enumerate(before):
        moved_k, moved_v = natural(layer, 1, [0, 1])
        torch.testing.assert_close(moved_v, v)
        if k is None:
            assert moved_k is None  # K = V: nothing to rotate
        else:
            torch.testing.assert_close(moved_k, k - 2, msg=f"layer {layer}")
    # the model rotated exactly the layers that keep keys, by attention layer
    assert sorted(shifted_by) == [0, 3, 4, 5, 6]
