"""Qwen3 and Qwen3-MoE against transformers: tiny random models from an HF directory and from a GGUF."""

import json

import pytest
import torch

from kvserve.errors import UnsupportedModelError
from kvserve.model.checkpoint import read_config
from kvserve.model.loader import load_model
from kvserve.model.moe import SparseMoE
from kvserve.model.qwen3 import Qwen3ForCausalLM
from tests.helpers import (QWEN3_VARIANTS, TINY_VOCAB, build_hf_model, paged_logits, reference_greedy,
                           reference_logits, save_hf_model)

SEQUENCE_LEN = 32
TOKENS = torch.randint(0, TINY_VOCAB, (SEQUENCE_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
CHUNKINGS = {"prefill then decode": [12], "chunked prefill": [5, 3, 4, 7], "all decode": [1]}
TOLERANCE = 1e-4


def assert_matches(model, expected: torch.Tensor) -> None:
    for name, chunks in CHUNKINGS.items():
        diff = (paged_logits(model, TOKENS, chunks) - expected).abs().max().item()
        assert diff <= TOLERANCE, f"{name}: max |logit diff| {diff:.2e}"
    recomputed = model(torch.tensor(TOKENS), torch.arange(SEQUENCE_LEN))  # no cache: the contiguous context
    assert (recomputed - expected).abs().max().item() <= TOLERANCE


def greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """kvserve's greedy continuation, recomputing the whole sequence each step (no cache)."""
    out = list(ids)
    for _ in range(num_tokens):
        logits = model(torch.tensor(out), torch.arange(len(out)), logits_indices=torch.tensor([len(out) - 1]))
        out.append(int(logits[0].argmax()))
    return out[len(ids):]


@pytest.mark.parametrize("variant", sorted(QWEN3_VARIANTS))
def test_hf_directory_matches_transformers(variant, tmp_path):
    hf_model = build_hf_model(variant)
    hf = hf_model.config
    loaded = load_model(save_hf_model(hf_model, tmp_path))
    assert isinstance(loaded.model, Qwen3ForCausalLM) and loaded.config.architecture == hf.architectures[0]
    assert loaded.config.head_dim == hf.head_dim  # decoupled from hidden / heads in all but one variant
    moe = [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, SparseMoE)]
    if "moe" in variant:
        assert len(moe) == hf.num_hidden_layers and loaded.config.num_experts == hf.num_experts
        assert loaded.config.norm_topk_prob == hf.norm_topk_prob
    else:
        assert not moe
    assert loaded.model.num_parameters() == sum(p.numel() for p in hf_model.parameters())
    assert_matches(loaded.model, reference_logits(hf_model, TOKENS))
    assert greedy(loaded.model, TOKENS[:8], 12) == reference_greedy(hf_model, TOKENS[:8], 12)


def test_qk_norm_and_routing_change_the_logits(tmp_path):
    # The parity above would prove little if the q/k norms or the router made no difference here.
    hf_model = build_hf_model("qwen3-moe")
    model = load_model(save_hf_model(hf_model, tmp_path)).model
    expected = reference_logits(hf_model, TOKENS)
    attention = model.layers[0].self_attn
    saved = attention.q_norm.weight.clone()
    attention.q_norm.weight.fill_(1.0)
    assert (paged_logits(model, TOKENS, [12]) - expected).abs().max() > 100 * TOLERANCE
    attention.q_norm.weight.copy_(saved)
    moe = model.layers[1].mlp
    moe.norm_topk_prob = False
    assert (paged_logits(model, TOKENS, [12]) - expected).abs().max() > 100 * TOLERANCE
    moe.norm_topk_prob = True
    moe.top_k = 1
    assert (paged_logits(model, TOKENS, [12]) - expected).abs().max() > 100 * TOLERANCE


def write_config(directory, variant="qwen3-moe", **changes):
    hf_model = build_hf_model(variant)
    save_hf_model(hf_model, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    return directory


@pytest.mark.parametrize("changes, message", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
])
def test_unsupported_configs_are_named(tmp_path, changes, message):
    with pytest.raises(UnsupportedModelError, match=message):
        read_config(write_config(tmp_path, **changes))


def test_hub_style_expert_count(tmp_path):
    # The Hub's Qwen3-MoE config.json files say num_experts; transformers 5 writes num_local_experts.
    directory = write_config(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    (directory / "config.json").write_text(json.dumps(config))
    assert read_config(directory).num_experts == 8
