"""A tiny hybrid model for the engine's recurrent-state tests, independent of any real family: Llama
attention layers interleaved with a recurrent layer that keeps two state tensors (a causal conv's window
and a decayed sum), computed element by element so its bits do not depend on how rows are batched."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.config import ATTENTION, RECURRENT, ModelConfig
from kvserve.kv.attention import AttentionContext
from kvserve.kv.state.context import LayerState, StateContext, scan_sequences
from kvserve.model.causal_lm import CausalLM
from kvserve.model.layers import Linear, RMSNorm, RotaryEmbedding, new_parameter
from kvserve.model.llama import DecoderLayer
from kvserve.model.loader import LoadedModel

HIDDEN = 32
KERNEL = 3


class ToyRecurrentLayer(nn.Module):
    def __init__(self, config: ModelConfig, state_index: int) -> None:
        super().__init__()
        self.state_index = state_index
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.in_proj = Linear(config.hidden_size, config.hidden_size)
        self.out_proj = Linear(config.hidden_size, config.hidden_size)
        self.conv = new_parameter(config.hidden_size, KERNEL)
        self.decay = new_parameter(config.hidden_size)

    def recurrence(self, rows: torch.Tensor, state: LayerState | None) -> tuple[torch.Tensor, LayerState]:
        hidden = rows.shape[1]
        window, total = state if state is not None else (rows.new_zeros(hidden, KERNEL - 1), rows.new_zeros(hidden))
        padded = torch.cat([window.t(), rows])  # [K - 1 + n, H]
        mixed = sum(padded[k : k + rows.shape[0]] * self.conv[:, k] for k in range(KERNEL))
        decay = torch.sigmoid(self.decay)
        outputs = []
        for row in mixed:
            total = decay * total + row
            outputs.append(torch.tanh(total))
        return torch.stack(outputs), [padded[-(KERNEL - 1):].t().contiguous(), total]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext, layer: int,
                states: StateContext) -> torch.Tensor:
        mixed = scan_sequences(states, self.state_index, self.in_proj(self.norm(x)), self.recurrence)
        return x.add_(self.out_proj(mixed))


class ToyAttentionLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.inner = DecoderLayer(config, layer)
        self.self_attn = self.inner.self_attn
        self.attention_index = config.attention_layers.index(layer)

    def forward(self, x, cos, sin, kv, layer, states):
        return self.inner(x, cos, sin, kv, self.attention_index)


class ToyHybridForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        recurrent = config.recurrent_layers
        self.layers = nn.ModuleList(
            ToyRecurrentLayer(config, recurrent.index(i)) if i in recurrent else ToyAttentionLayer(config, i)
            for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.build_head()
        self.rotary_emb = RotaryEmbedding.of(config)


def toy_hybrid(vocab_size: int = 160, kinds: str = "RARA", seed: int = 0) -> LoadedModel:
    """A random-weight toy hybrid (R: recurrent layer, A: attention layer), float32."""
    config = ModelConfig(
        architecture="toy-hybrid", vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=64,
        num_layers=len(kinds), num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=10000.0,
        layer_kinds=tuple(RECURRENT if kind == "R" else ATTENTION for kind in kinds),
        recurrent_state=((HIDDEN, KERNEL - 1), (HIDDEN,)))
    model = ToyHybridForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return LoadedModel(config, model.eval(), None, "toy hybrid", "random")
