"""SmolLM3, Phi-3 / Phi-4-mini, OLMo 2, Granite and Ministral 3 against transformers, from a Hugging Face
directory and through a GGUF file laid out as llama.cpp's converter lays it out (tiny random models, fp32)."""

import json
from dataclasses import fields

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import UnsupportedModelError
from kvserve.model.loader import load_model
from tests.dense_variants import DENSE_VARIANTS, write_family_gguf
from tests.helpers import (TINY_VOCAB, build_hf_model, paged_logits, reference_greedy, reference_logits, run_to_finals,
                           save_hf_model)

PROMPT_LEN = 12
TOTAL = 40  # past every variant's short context (16), window (8) and no-RoPE layer


def _tokens(seed: int = 1) -> list[int]:
    return torch.randint(0, TINY_VOCAB, (TOTAL,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_matches(model, expected: torch.Tensor, token_ids: list[int]) -> None:
    # one prefill then cached decode steps; a chunked prefill; the recompute path (no cache)
    for chunks in ([PROMPT_LEN], [5, 3, 16, 7]):
        assert (paged_logits(model, token_ids, chunks) - expected).abs().max().item() <= 1e-4
    recomputed = model(torch.tensor(token_ids), torch.arange(len(token_ids)))
    assert (recomputed - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("variant", sorted(DENSE_VARIANTS))
def test_hf_directory_matches_transformers(variant, tmp_path):
    hf_model = build_hf_model(variant)
    loaded = load_model(save_hf_model(hf_model, tmp_path))
    assert loaded.config.architecture == hf_model.config.architectures[0]
    token_ids = _tokens()
    _assert_matches(loaded.model, reference_logits(hf_model, token_ids), token_ids)


@pytest.mark.parametrize("variant", sorted(DENSE_VARIANTS))
def test_gguf_matches_transformers(variant, tmp_path):
    hf_model = build_hf_model(variant)
    write_family_gguf(hf_model, tmp_path / "tiny.gguf")
    loaded = load_model(tmp_path / "tiny.gguf")
    token_ids = _tokens(2)
    _assert_matches(loaded.model, reference_logits(hf_model, token_ids), token_ids)
    hf_config = load_model(save_hf_model(hf_model, tmp_path / "hf")).config
    # what the file says is what config.json says (GGUF stores floats as fp32), but for what GGUF cannot hold:
    # the architecture's name, the LongRoPE factors (tensors, loaded with the weights)
    for field in fields(hf_config):
        ours, theirs = getattr(loaded.config, field.name), getattr(hf_config, field.name)
        if field.name not in ("architecture", "rope_scaling"):
            assert ours == (pytest.approx(theirs, rel=1e-6) if isinstance(theirs, float) else theirs), field.name
    assert loaded.config.rope_scaling.rope_type == hf_config.rope_scaling.rope_type


@pytest.mark.parametrize("variant", sorted(DENSE_VARIANTS))
def test_greedy_matches_transformers(variant, tmp_path):
    hf_model = build_hf_model(variant)
    prompt = _tokens(3)[:PROMPT_LEN]
    engine = Engine(EngineConfig(model=str(save_hf_model(hf_model, tmp_path)), kv_cache_memory="4MiB",
                                 weights_dtype="float32", speculative="off"))
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert run_to_finals(engine)[request_id].outputs[0].token_ids == reference_greedy(hf_model, prompt, 24)


def test_what_each_family_reads(tmp_path):
    configs = {variant: load_model(save_hf_model(build_hf_model(variant), tmp_path / variant)).config
               for variant in ("smollm3", "phi4-mini-longrope", "phi3-short-window", "granite", "ministral3")}
    assert configs["smollm3"].rope_layers == (True, True, True, False)
    phi4 = configs["phi4-mini-longrope"]
    assert (phi4.rotary_dim, phi4.sliding_window, phi4.rope_scaling.rope_type) == (12, None, "longrope")
    assert configs["phi3-short-window"].sliding_window == 8 and configs["phi3-short-window"].rotary_dim is None
    granite = configs["granite"]
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.logits_scaling,
            granite.attention_scale) == (12.0, 0.22, 8.0, 0.09)
    assert configs["ministral3"].query_temperature_beta == 0.1
    assert configs["ministral3"].rope_scaling.rope_type == "yarn"


@pytest.mark.parametrize("changes, message", [
    ({"layer_types": ["mamba", "attention", "attention"]}, "hybrid layers"),
    ({"num_local_experts": 4}, "experts"),
    ({"position_embedding_type": None}, "position_embedding_type None"),
])
def test_granite4_hybrid_moe_and_nope_are_refused_by_name(tmp_path, changes, message):
    directory = save_hf_model(build_hf_model("granite4-dense"), tmp_path)
    config = {**json.loads((directory / "config.json").read_text()), **changes}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(directory)


def test_multimodal_ministral3_is_refused_by_name(tmp_path):
    directory = save_hf_model(build_hf_model("ministral3"), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["Mistral3ForConditionalGeneration"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="Ministral3ForCausalLM"):
        load_model(directory)


@pytest.mark.parametrize("variant", sorted(DENSE_VARIANTS))
def test_memory_plan_counts_the_kv_the_engine_allocates(variant, tmp_path):
    from kvserve.config import EngineConfig as Config
    from kvserve.planner import plan, resolve_model

    hf_model = build_hf_model(variant)
    write_family_gguf(hf_model, tmp_path / "tiny.gguf")
    for source in (save_hf_model(hf_model, tmp_path / "hf"), tmp_path / "tiny.gguf"):
        name, config, params = resolve_model(str(source))
        result = plan(name, config, params, context=37, batch=3, kv_dtype="float32", block_size=16)
        cfg = hf_model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        assert result.bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
        engine = Engine(Config(model=str(source), kv_cache_memory=result.kv_bytes_total, kv_cache_dtype="float32",
                               block_size=16, max_num_seqs=3, weights_dtype="float32"))
        assert engine.kv_cache.bytes_allocated == result.kv_bytes_total
        if config.sliding_window is None:  # (Phi-3's window of 8 holds fewer)
            assert engine.kv_manager.num_blocks == 3 * 3  # ceil(37 / 16) for each of three requests


def test_catalog_sizes():
    from kvserve.model.catalog import KNOWN_MODELS, num_parameters

    billions = {name: num_parameters(KNOWN_MODELS[name]) / 1e9
                for name in ("SmolLM3-3B", "Phi-4-mini", "OLMo-2-7B", "Granite-3.3-8B")}
    assert billions == pytest.approx({"SmolLM3-3B": 3.08, "Phi-4-mini": 3.84, "OLMo-2-7B": 7.30,
                                      "Granite-3.3-8B": 8.17}, abs=0.01)


def test_longrope_gguf_without_its_factors_is_refused(tmp_path):
    import gguf
    import numpy as np

    from kvserve.errors import ModelLoadError

    write_family_gguf(build_hf_model("phi4-mini-longrope"), tmp_path / "full.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "full.gguf"))
    writer = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "phi3")
    for field in reader.fields.values():
        if field.name.startswith("phi3.") and field.types:
            value = field.contents()
            writer.add_key_value(field.name, value, field.types[0])
    for tensor in reader.tensors:
        if not tensor.name.startswith("rope_factors"):
            writer.add_tensor(tensor.name, np.array(tensor.data).reshape(tuple(reversed(tensor.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="rope_factors"):
        load_model(tmp_path / "cut.gguf")
