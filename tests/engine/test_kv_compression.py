"""KV compression in the engine (issue 43): a request's prompt chunks compressed in the paged pool.

Small chunks (16 tokens, blocks of 4) so that a 60-token prompt compresses several chunks in a tiny model.
"""

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import ConfigError, InvalidRequestError
from kvserve.kv.compression import CompressedPrefixContext, CompressionSpec, PromptCapture, gather_kept
from kvserve.kv.compression.compact import kept_indices
from kvserve.structured.params import StructuredOutputsParams
from tests.helpers import TINY_VOCAB, run_to_finals
from tests.server.inprocess import with_tiny_tokenizer

BS, CHUNK = 4, 16


def engine_with(loaded, spec: CompressionSpec | None, **overrides) -> Engine:
    config = dict(block_size=BS, kv_cache_memory="2MiB", max_num_batched_tokens=CHUNK, speculative="off")
    config.update(overrides)
    engine = Engine(EngineConfig(**config), loaded=loaded)
    engine.compression.default = spec  # the flag's chunk is 512: tests use 16-token chunks
    return engine


def prompt(length, seed=0):
    return torch.randint(0, TINY_VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens=8, **extra):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, logprobs=0, **extra)


def run(engine, tokens, params=None):
    request_id = engine.add_request(tokens, params or greedy())
    final = run_to_finals(engine)[request_id]
    out = final.outputs[0]
    return list(out.token_ids), [t.logprob for t in out.logprobs], final


def spec(method="knorm", ratio=2.0, window=4, sinks=2):
    return CompressionSpec(method, ratio, sinks=sinks, window=window, chunk=CHUNK)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_keeping_every_token_equals_no_compression_bit_for_bit(tiny_models, kv_dtype):
    # Ratio 1 still stops at chunk ends and runs the compaction (every row moved onto itself): same bits.
    loaded = tiny_models("llama-gqa")
    tokens = prompt(60)
    plain = run(engine_with(loaded, None, kv_cache_dtype=kv_dtype), tokens)
    kept = run(engine_with(loaded, spec(ratio=1.0), kv_cache_dtype=kv_dtype), tokens)
    assert plain[:2] == kept[:2]


def test_compression_holds_fewer_blocks_and_returns_every_one(tiny_models):
    loaded = tiny_models("llama-gqa")
    tokens = prompt(60)
    engine = engine_with(loaded, spec(ratio=2.0))
    _, _, final = run(engine, tokens)
    # 60 prompt tokens, window 4: chunks 0..2 compressed (48 tokens -> 24 slots), 12 + 8 tokens after them.
    plain_engine = engine_with(loaded, None)
    _, _, plain_final = run(plain_engine, tokens)
    assert 0 < final.kv_cache_bytes < plain_final.kv_cache_bytes
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert final.outputs[0].token_ids  # it generated over its compressed prompt


def test_abort_mid_prefill_returns_every_block(tiny_models):
    engine = engine_with(tiny_models("llama-gqa"), spec(ratio=4.0))
    request_id = engine.add_request(prompt(60), greedy())
    for _ in range(3):  # three 16-token chunks computed, two compressed
        engine.step()
        engine.check_integrity()
    assert engine.kv_manager.dropped_tokens(request_id) == 2 * (CHUNK - CHUNK // 4)
    engine.abort(request_id)
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert not engine.kv_manager.compressed.policies


@pytest.mark.parametrize("method", ["knorm", "keydiff", "streaming"])
def test_one_layer_model_matches_attention_over_the_kept_tokens(tiny_models, method):
    # One layer: a token's K/V depend on the token and its position only, so the kept K/V are those of the whole
    # prompt's contiguous forward, chunk by chunk; the tokens after the compressed chunks attend over them and
    # each other (attend_kept, in torch) in the reference, over the paged kept blocks (C++ kernels) in the engine.
    loaded = tiny_models("llama-1-layer")
    tokens, compression = prompt(60, seed=3), spec(method, 2.0)
    outputs, logprobs, _ = run(engine_with(loaded, compression), tokens, greedy(6))
    capture = PromptCapture(torch.arange(60), loaded.model.layer_windows)
    loaded.model(torch.tensor(tokens), torch.arange(60), capture)
    kv = capture.layers()[0]
    kept_k, kept_v, kept_pos = [], [], []
    for chunk in range(3):  # chunks 0, 1, 2 are followed by >= 4 prompt tokens
        part = slice(chunk * CHUNK, (chunk + 1) * CHUNK)
        kept = kept_indices(kv.keys[:, part], kv.values[:, part], kv.positions[part], compression, CHUNK // 2,
                            compression.sinks if chunk == 0 else 0)
        layer = gather_kept(kv.keys[:, part], kv.values[:, part], kv.positions[part], kept)
        kept_k.append(layer.keys), kept_v.append(layer.values), kept_pos.append(layer.positions)
    prefix = gather_kept(torch.cat(kept_k, 1), torch.cat(kept_v, 1), torch.cat(kept_pos, 1)[0],
                         torch.arange(3 * CHUNK // 2).expand(kv.keys.shape[0], -1))
    prefix = type(prefix)(prefix.keys, prefix.values, torch.cat(kept_pos, 1), prefix.indices)
    after = tokens[3 * CHUNK :] + outputs[:-1]
    positions = torch.arange(3 * CHUNK, 3 * CHUNK + len(after))
    logits = loaded.model(torch.tensor(after), positions, CompressedPrefixContext(positions, [prefix], [None]))
    reference = logits[-len(outputs):].log_softmax(-1)
    assert reference.argmax(-1).tolist() == outputs
    got = torch.tensor(logprobs)
    expected = reference.gather(1, torch.tensor(outputs)[:, None])[:, 0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_request_override_and_none(tiny_models):
    loaded = tiny_models("llama-gqa")
    engine = engine_with(loaded, spec())
    request_id = engine.add_request(prompt(60), greedy(kv_compression="none"))
    assert engine.scheduler.requests[request_id].compression is None
    engine.abort(request_id)
    request_id = engine.add_request(prompt(60), greedy(kv_compression="keydiff:4"))
    assert engine.scheduler.requests[request_id].kv_compression.method == "keydiff"
    with pytest.raises(InvalidRequestError, match="expected_attention|queries"):
        engine.add_request(prompt(60), greedy(kv_compression="expected_attention:2"))
    with pytest.raises(InvalidRequestError, match="METHOD:RATIO"):
        engine.add_request(prompt(60), greedy(kv_compression="knorm"))


def test_structured_output_over_a_compressed_prompt(tiny_models):
    # Structured output constrains sampling only: a compressed request follows its grammar as any other.
    engine = engine_with(with_tiny_tokenizer(tiny_models("llama-gqa")), spec())
    params = greedy(8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    request_id = engine.add_request(prompt(60), params)
    final = run_to_finals(engine)[request_id]
    assert final.outputs[0].text in ("yes", "no")


@pytest.mark.parametrize("overrides, message", [
    (dict(context_overflow="shift", max_model_len=128), "context shift"),
    (dict(kv_compression="expected_attention:2"), "queries"),
    (dict(kv_compression="knorm"), "METHOD:RATIO"),
    (dict(kv_cache_dtype="int4"), "encodes whole blocks"),
    (dict(enable_kv_cache=False), "without a KV cache"),
])
def test_refused_at_startup_with_the_reason(tiny_models, overrides, message):
    config = dict(block_size=BS, kv_cache_memory="2MiB", kv_compression="knorm:2")
    config.update(overrides)
    with pytest.raises(ConfigError, match=message):
        Engine(EngineConfig(**config), loaded=tiny_models("llama-gqa"))


def test_a_second_request_reuses_the_compressed_blocks_and_answers_the_same(tiny_models):
    loaded = tiny_models("llama-gqa")
    tokens = prompt(60, seed=5)
    cold = run(engine_with(loaded, spec()), tokens)
    engine = engine_with(loaded, spec())
    first = run(engine, tokens)
    second = run(engine, tokens[:56] + prompt(8, seed=6))  # the same 3 compressed chunks, another tail
    again = run(engine, tokens)
    assert first[:2] == cold[:2] == again[:2]  # a hit changes the cost, never the answer
    assert second[2].num_cached_tokens == 56  # the 3 chunks' kept blocks (48 tokens), then 2 tail blocks
    assert again[2].num_cached_tokens == 56  # everything but the last block (the last token is computed)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    # Cold for the second prompt: the same answer as through the cache.
    assert run(engine_with(loaded, spec()), tokens[:56] + prompt(8, seed=6))[:2] == second[:2]


@pytest.mark.parametrize("other", [None, spec(ratio=4.0), spec(method="keydiff")])
def test_another_spec_or_none_never_reads_compressed_blocks(tiny_models, other):
    loaded = tiny_models("llama-gqa")
    tokens = prompt(60, seed=7)
    engine = engine_with(loaded, spec())
    run(engine, tokens)
    engine.compression.default = other
    _, _, final = run(engine, tokens)
    assert final.num_cached_tokens == 0


def test_a_plain_request_cached_first_is_not_read_by_a_compressing_one(tiny_models):
    loaded = tiny_models("llama-gqa")
    tokens = prompt(60, seed=8)
    engine = engine_with(loaded, None)
    run(engine, tokens)
    engine.compression.default = spec()
    _, _, final = run(engine, tokens)
    assert final.num_cached_tokens == 0


def test_preempted_compressing_requests_answer_as_they_would_alone(tiny_models):
    # A pool too small for three at once: requests are preempted mid-prefill or mid-decode and come back through
    # their own cached compressed blocks (or recompute them), with the same tokens as alone.
    loaded = tiny_models("llama-gqa")
    page_bytes = engine_with(loaded, None).kv_spec.page_bytes(BS)
    prompts = [prompt(60, seed=20 + i) for i in range(3)]
    alone = [run(engine_with(loaded, spec()), tokens, greedy(12))[0] for tokens in prompts]
    engine = engine_with(loaded, spec(), kv_cache_memory=page_bytes * 26, max_num_batched_tokens=24)
    ids = [engine.add_request(tokens, greedy(12)) for tokens in prompts]
    finals = run_to_finals(engine)
    assert engine.scheduler.num_preemptions > 0
    assert [list(finals[i].outputs[0].token_ids) for i in ids] == alone
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
