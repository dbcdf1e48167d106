"""CausalLM, the forward every family shares: the context shift's key re-rotation uses each layer's own RoPE."""

import torch

from kvserve.kernels.ops import apply_rope
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.llama import LlamaForCausalLM
from tests.helpers import build_hf_model, save_hf_model


def _model(variant, tmp_path):
    from kvserve.model.loader import load_model

    return load_model(save_hf_model(build_hf_model(variant), tmp_path)).model


def test_shifted_keys_are_the_keys_rotated_by_the_delta_with_the_layers_rope(tmp_path):
    model = _model("gemma3", tmp_path)
    assert isinstance(model, Gemma3ForCausalLM)
    keys = torch.randn(5, model.config.num_kv_heads, model.config.head_dim)
    local = next(i for i, layer in enumerate(model.layers) if layer.self_attn.local_rope)
    glob = next(i for i, layer in enumerate(model.layers) if not layer.self_attn.local_rope)
    for layer, rotary in ((local, model.local_rotary_emb), (glob, model.rotary_emb)):
        cos, sin = rotary(torch.tensor([7]))
        torch.testing.assert_close(model.shift_key_positions(layer, keys, 7), apply_rope(keys, cos, sin))
        # A rotation: shifting back undoes it.
        torch.testing.assert_close(model.shift_key_positions(layer, model.shift_key_positions(layer, keys, 7), -7),
                                   keys, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(model.shift_key_positions(local, keys, 7), model.shift_key_positions(glob, keys, 7))


def test_the_shared_forward_scores_only_the_rows_asked_for(tmp_path):
    model = _model("llama-gqa", tmp_path)
    assert isinstance(model, LlamaForCausalLM)
    ids, positions = torch.randint(0, model.config.vocab_size, (6,)), torch.arange(6)
    every_row = model(ids, positions)
    torch.testing.assert_close(model(ids, positions, logits_indices=torch.tensor([5, 2])), every_row[[5, 2]])
