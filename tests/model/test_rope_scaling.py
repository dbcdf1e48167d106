"""YaRN and LongRoPE tables and partial RoPE against transformers' own functions, bit for bit."""

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rope

from kvserve.kernels import ops
from kvserve.model.family import hf_rope
from kvserve.model.layers import RotaryEmbedding
from kvserve.model.rope_scaling import attention_factor

YARN = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "long_factor": [1.0 + i for i in range(12)], "short_factor": [1.0 + i / 10 for i in range(12)]}


@pytest.mark.parametrize("params, context", [
    ({**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}, 4096),
    ({**YARN, "mscale": 1.0, "mscale_all_dim": 0.0}, 4096),  # no mscale pair: mscale(factor)
    ({**YARN, "truncate": False, "beta_fast": 16.0}, 4096),
    ({**LONGROPE, "partial_rotary_factor": 0.75}, 4096),  # long set
    ({**LONGROPE, "partial_rotary_factor": 0.75}, 64),  # short set, no attention factor
])
def test_tables_equal_transformers(params, context):
    shape = dict(hidden_size=512, num_attention_heads=16, max_position_embeddings=context, rope_parameters=dict(params))
    config = (transformers.Phi3Config(original_max_position_embeddings=params["original_max_position_embeddings"], **shape)
              if params["rope_type"] == "longrope" else transformers.LlamaConfig(**shape))
    head_dim = 32
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    # transformers picks LongRoPE's set by the sequence: a length past the original context for the long one
    seq_len = context if context > params["original_max_position_embeddings"] else None
    theirs, their_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", seq_len=seq_len)
    theta, scaling = hf_rope(params, 10000.0, context)
    rotary = RotaryEmbedding(rotary_dim, theta, scaling, context)
    assert torch.equal(rotary.inv_freq, theirs)
    assert attention_factor(scaling) == their_factor == rotary.attention_factor


def test_partial_rope_rotates_the_first_channels_only():
    theta, scaling = hf_rope({**LONGROPE, "partial_rotary_factor": 0.75}, 10000.0, 4096)
    rotary = RotaryEmbedding(24, theta, scaling, 4096)  # 24 of a head of 32
    positions = torch.tensor([0, 5, 70, 4000])
    cos, sin = rotary(positions)
    x = torch.randn(4, (3 + 1) * 32, generator=torch.Generator().manual_seed(0))
    q = x[:, : 3 * 32].reshape(4, 3, 32).transpose(0, 1)[None]
    k = x[:, 3 * 32 :].reshape(4, 1, 32).transpose(0, 1)[None]
    expected_q, expected_k = phi3_apply_rope(q, k, cos[None], sin[None])
    ops.rope_(x, cos, sin, 3 + 1, 32)
    torch.testing.assert_close(x[:, : 3 * 32], expected_q[0].transpose(0, 1).reshape(4, -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(x[:, 3 * 32 :], expected_k[0].transpose(0, 1).reshape(4, -1), rtol=0, atol=1e-6)
