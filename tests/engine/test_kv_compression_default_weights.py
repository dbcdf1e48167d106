"""KV compression on the embedded SmolLM2 as the engine serves it by default (its GGUF codes, auto weights): a
compressing request answers the same cold, from the prefix cache and in small prefill chunks; and the queries the
engine's kernels compute for a chunk do not depend on how the prefill was split (what a chunk-local query-based
scorer would rely on)."""

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.kernels import ops
from kvserve.kv.attention.cpu import PagedKVContext
from kvserve.model import decoder_stack
from tests.helpers import run_to_finals

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not ops.available(), reason="the C++ kernels are not built")]
PROMPT_TOKENS = 640  # one canonical 512-token chunk compressed (the prompt goes on >= 64 tokens past it)


@pytest.fixture(scope="module")
def smollm2():
    from kvserve.model.loader import load_model

    return load_model(weights_dtype="auto")


@pytest.fixture(scope="module")
def tokens(smollm2):
    text = " ".join(f"Note {i}: the {['red', 'blue', 'green'][i % 3]} box on shelf {i * 7 % 31} holds {i * 13 % 97} "
                    f"items, moved there on day {i % 28 + 1}." for i in range(80))
    ids = smollm2.require_tokenizer().encode(text)
    assert len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


def engine(loaded, compression: str | None, **overrides) -> Engine:
    config = dict(kv_compression=compression, kv_cache_memory="256MiB", max_model_len=1024)
    config.update(overrides)
    return Engine(EngineConfig(**config), loaded=loaded)


def answer(engine_: Engine, tokens: list[int]):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    request_id = engine_.add_request(tokens, params)
    final = run_to_finals(engine_)[request_id]
    out = final.outputs[0]
    return list(out.token_ids), [t.logprob for t in out.logprobs], final


def test_a_compressing_request_answers_the_same_cold_cached_and_chunked(smollm2, tokens):
    warm = engine(smollm2, "auto:2")
    cold = answer(warm, tokens)
    assert cold[2].num_dropped_tokens == 512 - 256  # chunk 0 kept 256 of its 512 tokens
    cached = answer(warm, tokens)
    assert cached[2].num_cached_tokens > 0  # chunk 0's kept blocks and the plain blocks after them
    chunked = answer(engine(smollm2, "auto:2", max_num_batched_tokens=48), tokens)
    assert cold[:2] == cached[:2] == chunked[:2]  # a hit, or another split, changes the cost, never the answer
    plain = answer(engine(smollm2, None), tokens)
    same = sum(a == b for a, b in zip(plain[0], cold[0]))
    print(f"auto:2 vs uncompressed: {same} of {len(plain[0])} greedy tokens the same "
          f"({plain[0]} vs {cold[0]})")  # reported, not asserted: compression may change the answer


def prompt_queries(loaded, tokens: list[int], monkeypatch, **overrides) -> list[torch.Tensor]:
    """Per layer, the queries `[T, H, D]` the engine's attention received for the prompt's tokens, in order
    (from the layers one by one: the decoder stack computes the same bits, tests/model/test_decoder_stack.py)."""
    seen: dict[int, list[torch.Tensor]] = {}
    original = PagedKVContext.attend
    monkeypatch.setattr(decoder_stack, "ENABLED", False)

    def recording(self, layer, q, *args, **kwargs):
        seen.setdefault(layer, []).append(q.detach().clone())
        return original(self, layer, q, *args, **kwargs)

    monkeypatch.setattr(PagedKVContext, "attend", recording)
    answer(engine(loaded, "auto:2", speculative="off", **overrides), tokens)
    monkeypatch.setattr(PagedKVContext, "attend", original)
    return [torch.cat(seen[layer])[: len(tokens)] for layer in sorted(seen)]


def test_a_chunks_queries_are_the_same_however_the_prefill_was_split(smollm2, tokens, monkeypatch):
    whole = prompt_queries(smollm2, tokens, monkeypatch, max_num_batched_tokens=2048)
    for step in (48, 100):  # 100: a step boundary inside chunk 0's last 64 queries (at 500)
        split = prompt_queries(smollm2, tokens, monkeypatch, max_num_batched_tokens=step)
        assert len(split) == len(whole) == smollm2.config.num_layers
        for layer, (a, b) in enumerate(zip(whole, split)):
            assert a.shape == b.shape and torch.equal(a, b), f"layer {layer}, prefill steps of {step}"
