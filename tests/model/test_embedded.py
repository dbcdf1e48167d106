"""The embedded SmolLM2-135M-Instruct GGUF against transformers' own GGUF loading."""

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.model.loader import embedded_model_path
from tests.helpers import reference_greedy, run_to_finals

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]

pytestmark = pytest.mark.slow


def run(engine: Engine, prompt, params: SamplingParams):
    request_id = engine.add_request(prompt, params)
    return run_to_finals(engine)[request_id]


@pytest.fixture(scope="module")
def engine(embedded):
    return Engine(EngineConfig(kv_cache_memory="128MiB"), loaded=embedded)


@pytest.fixture(scope="module")
def reference_model():
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_summary_describes_the_model(embedded):
    summary = embedded.summary()
    assert "30 layers, 9 heads / 3 KV heads (GQA) / head_dim 64" in summary
    assert "context 8192" in summary
    assert "46,080 bytes/token" in summary
    assert "Q4_1" in summary


def test_first_step_logits_match_transformers(embedded, embedded_tokenizer, reference_model):
    for prompt in PROMPTS:
        ids = embedded_tokenizer.encode(prompt)
        with torch.no_grad():
            expected = reference_model(torch.tensor([ids])).logits[0, -1]
        ours = embedded.model(torch.tensor(ids), torch.arange(len(ids)))[-1]
        assert (ours - expected).abs().max().item() <= 1e-3


def test_greedy_continuations_match_transformers(engine, embedded_tokenizer, reference_model):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        ids = embedded_tokenizer.encode(prompt)
        expected = reference_greedy(reference_model, ids, 32)
        assert run(engine, ids, params).outputs[0].token_ids == expected


def test_cached_and_recomputed_decoding_agree(engine, embedded):
    recompute_engine = Engine(EngineConfig(kv_cache_memory="128MiB", enable_kv_cache=False), loaded=embedded)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        cached = run(engine, prompt, params)
        recomputed = run(recompute_engine, prompt, params)
        assert cached.outputs[0].token_ids == recomputed.outputs[0].token_ids
        blocks = -(-(len(cached.prompt_token_ids) + 23) // 16)  # the last token's K/V is never computed
        assert cached.kv_cache_bytes == blocks * 16 * 46_080
        assert recomputed.kv_cache_bytes == 0


def test_chat_stops_on_end_of_turn(engine, embedded):
    prompt = embedded.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    result = run(engine, prompt, SamplingParams(max_tokens=64, temperature=0.0))
    completion = result.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] in embedded.tokenizer.stop_token_ids
    assert "Paris" in completion.text
    assert "<|im_end|>" not in completion.text
