"""The vLLM-style offline API."""

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import ConfigError, InvalidRequestError
from tests.helpers import build_hf_model, save_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_hf_model(build_hf_model("llama-gqa"), tmp_path_factory.mktemp("llm")))


def test_unknown_engine_arguments_are_rejected_by_name(tiny_dir):
    with pytest.raises(ConfigError, match="unknown engine argument\\(s\\): enable_prefix_cachin, tensor_parallel_size"):
        LLM(tiny_dir, tensor_parallel_size=2, enable_prefix_cachin=True)
    with pytest.raises(ConfigError, match="block_size must be a positive integer"):
        LLM(tiny_dir, block_size=0)
    with pytest.raises(ConfigError, match="cannot read 'lots'"):
        LLM(tiny_dir, kv_cache_memory="lots")


def test_generate_returns_outputs_in_input_order(tiny_dir):
    llm = LLM(tiny_dir, kv_cache_memory="8MiB", block_size=8, max_num_seqs=4)
    prompts = [[1, 2, 3], [4] * 30, [5, 6], [7] * 12, [8]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 2, 5, 7, 3)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [9, 2, 5, 7, 3]
    for output in outputs:
        assert output.finished and output.outputs[0].finish_reason == "length"
        assert output.num_cached_tokens == 0
        assert output.metrics.ttft > 0 and output.metrics.num_output_tokens == len(output.outputs[0].token_ids)
    # a single prompt (token ids) and a single SamplingParams are accepted too
    (single,) = llm.generate([1, 2, 3], params[0], use_tqdm=False)
    assert single.outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_a_bad_prompt_in_a_batch_leaves_nothing_behind(tiny_dir):
    llm = LLM(tiny_dir, kv_cache_memory="8MiB")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 2], [99999]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    llm.engine.check_integrity()


def test_mismatched_params_list(tiny_dir):
    llm = LLM(tiny_dir, kv_cache_memory="8MiB")
    with pytest.raises(InvalidRequestError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[1]], [SamplingParams(), SamplingParams()])


@pytest.mark.slow
def test_embedded_model_by_default_with_text_prompts():
    llm = LLM(kv_cache_memory="128MiB")
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(["The capital of France is", "1, 2, 3, 4,"], SamplingParams(max_tokens=8, temperature=0.0))
    assert "Paris" in outputs[0].outputs[0].text
    assert outputs[0].prompt == "The capital of France is"
    assert outputs[1].prompt_token_ids == tokenizer.encode("1, 2, 3, 4,")


def test_a_script_without_logging_set_up_sees_which_kernels_run(tiny_dir):
    """As vLLM's LLM(): kvserve's INFO lines reach stderr unless the application configured logging."""
    import os
    import subprocess
    import sys

    script = f"from kvserve.llm import LLM; LLM(model={str(tiny_dir)!r}, kv_cache_memory='8MiB')"
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert "kernels: " in shown.stderr
    quiet = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True,
                           env={**os.environ, "KVSERVE_CONFIGURE_LOGGING": "0"})
    assert "kernels: " not in quiet.stderr  # INFO, unshown; only a failed build (a warning) would show
