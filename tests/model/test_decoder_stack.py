"""A Llama-family model's layers in one kernel call (kvserve.model.decoder_stack) give the layers' own bits."""

import time

import pytest
import torch

from kvserve.kernels import ops
from kvserve.kv.attention import CpuAttentionBackend, SequenceSlice
from kvserve.kv.cache.kv_spec import kv_spec
from kvserve.model import decoder_stack
from kvserve.model.loader import load_model
from tests.helpers import TINY_VOCAB, build_hf_model, paged_logits, save_hf_model, write_gguf
from tests.model.test_kquant_linear import Q4_K_M

pytestmark = pytest.mark.skipif(not ops.available(), reason="the decoder stack is a C++ kernel")

TOKENS = torch.randint(0, TINY_VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()
CHUNKS = [13, 6, 1, 9]  # prefill chunks (rows of the paged decode on a float cache), then decodes


def _count_runs(monkeypatch) -> list[int]:
    runs = []
    real = decoder_stack.run_stack
    monkeypatch.setattr(decoder_stack, "run_stack", lambda *args: runs.append(1) or real(*args))
    return runs


def _both_ways(model, monkeypatch, cache_dtype: str = "float16") -> tuple[torch.Tensor, torch.Tensor, int]:
    """Logits with the layers one by one and as one stack, and how many steps ran as a stack."""
    monkeypatch.setattr(decoder_stack, "ENABLED", False)
    layers = paged_logits(model, TOKENS, CHUNKS, cache_dtype=cache_dtype)
    monkeypatch.setattr(decoder_stack, "ENABLED", True)
    runs = _count_runs(monkeypatch)
    stacked = paged_logits(model, TOKENS, CHUNKS, cache_dtype=cache_dtype)
    return layers, stacked, len(runs)


@pytest.mark.parametrize("cache_dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("variant,weights", [("llama-gqa", "int4"), ("llama-mqa", "int8"), ("qwen2-bias", "int4")])
def test_group_code_layers_as_a_stack_give_the_layers_bits(variant, weights, cache_dtype, tmp_path, monkeypatch):
    model = load_model(save_hf_model(build_hf_model(variant), tmp_path), weights_dtype=weights).model
    layers, stacked, runs = _both_ways(model, monkeypatch, cache_dtype)
    assert runs == len(CHUNKS) + len(TOKENS) - sum(CHUNKS)  # every step, prefill chunks too
    assert torch.equal(layers, stacked)


def test_k_quant_layers_as_a_stack_give_the_layers_bits(tmp_path, monkeypatch):
    # A Q4_K_M file: QKV and gate-up of several K-quant parts each, each filling its columns.
    path = tmp_path / "q4_k_m.gguf"
    write_gguf(build_hf_model("llama-wide"), path, Q4_K_M)
    model = load_model(path, weights_dtype="auto").model
    layers, stacked, runs = _both_ways(model, monkeypatch)
    assert runs > 0 and torch.equal(layers, stacked)


def test_models_the_stack_does_not_hold_run_their_layers(tmp_path, monkeypatch):
    # fp32 weights: no stack (the layers multiply with torch's GEMM); the logits are the layers' own.
    model = load_model(save_hf_model(build_hf_model("llama-gqa"), tmp_path), weights_dtype="float32").model
    layers, stacked, runs = _both_ways(model, monkeypatch)
    assert runs == 0 and model.__dict__["_decoder_stack"] is None and torch.equal(layers, stacked)


def test_a_family_built_on_llamas_layers_keeps_its_own_forward(tmp_path, monkeypatch):
    # Granite scales each branch of Llama's layers: its layers are not the stack's.
    model = load_model(save_hf_model(build_hf_model("granite"), tmp_path), weights_dtype="int8").model
    layers, stacked, runs = _both_ways(model, monkeypatch)
    assert runs == 0 and torch.equal(layers, stacked)


def test_timing_the_stacks_ops_splits_its_forwards_and_changes_no_bits(tmp_path):
    model = load_model(save_hf_model(build_hf_model("llama-gqa"), tmp_path), weights_dtype="int4").model
    untimed = paged_logits(model, TOKENS, CHUNKS)
    stack = model.decoder_stack()
    assert stack is not None
    decoder_stack.time_stack_ops(stack, True)
    started = time.perf_counter()
    timed = paged_logits(model, TOKENS, CHUNKS)
    wall = time.perf_counter() - started
    seconds = decoder_stack.stack_op_times(stack)
    assert torch.equal(untimed, timed)
    assert list(seconds) == list(decoder_stack.STACK_OPS)
    assert all(value > 0 for value in seconds.values())  # every op ran in every step
    assert sum(seconds.values()) < wall  # the stack's share of the steps, not more
    assert set(decoder_stack.stack_op_times(stack).values()) == {0.0}  # taken: the counts restart
    decoder_stack.time_stack_ops(stack, False)
    paged_logits(model, TOKENS, CHUNKS)
    assert set(decoder_stack.stack_op_times(stack).values()) == {0.0}


def _step(config, cache_dtype: str, slices: int = 1):
    backend = CpuAttentionBackend()
    cache = backend.allocate_kv_cache(kv_spec(config, cache_dtype), 16, 4)
    cache.initialize_blocks_through(15)
    return backend.build_context(cache, [SequenceSlice(([2 * i, 2 * i + 1],), 3, 1) for i in range(slices)])


def test_only_plain_float_caches_are_a_plain_paged_step(tmp_path):
    config = load_model(save_hf_model(build_hf_model("llama-gqa"), tmp_path)).config
    step = _step(config, "float16", slices=2).plain_paged_step()
    assert step is not None and step.slots.numel() == 2 * config.num_kv_heads  # two decodes
    assert _step(config, "int8").plain_paged_step() is None  # quantized rows: the quantized decode
    assert _step(config, "int4").plain_paged_step() is None
