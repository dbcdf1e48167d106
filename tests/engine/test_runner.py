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
