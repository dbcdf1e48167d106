"""Where a Qwen3.5 step goes: one 512-token prefill and 32 decode steps of a Qwen3.5-0.8B-shaped model with random
fp32 weights, through the paged KV cache and the state cache, timed by part.

Parts: the Gated DeltaNet layers' in-projection (q/k/v, z, b, a in one GEMM), causal conv, delta rule (the
token-by-token kernel, kvserve/kernels/csrc/gated_delta.cpp, for prefill and decode alike), out-projection and the rest (gated RMSNorm, decay/beta, per-sequence state reads and writes); the
attention layers' projections and the rest (q/k norm, RoPE, attention, output gate); the MLPs; the head; and
everything else (embedding, the residual norms). Each part is wall time inside its modules or functions, summed.

    .venv/bin/python bench/qwen35_profile.py [--prompt 512] [--steps 32] [--weights-dtype auto] [--threads N]

Linear layers as --weights-dtype says (auto: what the engine holds by default on this CPU, int4 where the C++
matmul has a SIMD path); the fp32 default pads fewer than 16 rows to 16 (kvserve/model/float_gemm.py), so a
decode step's GEMMs cost 16 rows' there.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict

import torch

from kvserve.config import ATTENTION, RECURRENT, GatedDeltaNetShape, ModelConfig
from kvserve.cpu_features import describe_cpu
from kvserve.kv.attention import CpuAttentionBackend, SequenceSlice
from kvserve.kv.cache.kv_spec import kv_spec
from kvserve.kv.state.context import StateSequence
from kvserve.kv.state.state_spec import state_spec
from kvserve.kv.state.storage import StateCache
from kvserve.kernels import gated_delta
from kvserve.model.short_conv import CausalDepthwiseConv
from kvserve.model.quantized_linear import convert_linear_weights
from kvserve.model.qwen35 import Qwen35ForCausalLM


def qwen35_0_8b_config() -> ModelConfig:
    """Qwen3.5-0.8B's text shape (24 layers, every 4th full attention; tied 248,320-token embedding)."""
    shape = GatedDeltaNetShape(num_key_heads=16, num_value_heads=16, key_head_dim=128, value_head_dim=128,
                               conv_kernel=4)
    kinds = tuple(ATTENTION if (i + 1) % 4 == 0 else RECURRENT for i in range(24))
    return ModelConfig(architecture="Qwen3_5ForCausalLM", vocab_size=248320, hidden_size=1024,
                       intermediate_size=3584, num_layers=24, num_heads=8, num_kv_heads=2, head_dim=256,
                       max_position_embeddings=262144, rms_norm_eps=1e-6, rope_theta=10_000_000.0,
                       tie_word_embeddings=True, rotary_dim=64, layer_kinds=kinds,
                       recurrent_state=shape.state_shapes, gated_deltanet=shape)


def random_model(config: ModelConfig) -> Qwen35ForCausalLM:
    model = Qwen35ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty_like(param).uniform_(1, 16, generator=generator).log())
            elif name.endswith("dt_bias") or "norm" in name:
                param.fill_(1.0 if name.endswith("dt_bias") or "linear_attn.norm" in name else 0.0)
            else:
                param.normal_(0, 0.02, generator=generator)
    return model


class PartTimer:
    """Wall seconds per part: modules (forward hooks) and the delta-rule functions (wrapped)."""

    def __init__(self, model: Qwen35ForCausalLM) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._started: dict[int, float] = {}
        for layer in model.layers:
            if layer.attends:
                self._time(layer.self_attn, "attention: rest")
                self._time(layer.self_attn.qkv_proj, "attention: q/k/v projection")
                self._time(layer.self_attn.o_proj, "attention: o projection")
            else:
                self._time(layer.linear_attn, "deltanet: rest")
                self._time(layer.linear_attn.in_proj, "deltanet: in-projection")
                self._time(layer.linear_attn.out_proj, "deltanet: out-projection")
            self._time(layer.mlp, "mlp")
        self._time(model.lm_head, "head")
        for name in ("gated_delta_rule_slots_", "gated_delta_rule"):
            setattr(gated_delta, name, self._wrap(getattr(gated_delta, name), "deltanet: delta rule"))
        CausalDepthwiseConv.run = self._wrap(CausalDepthwiseConv.run, "deltanet: causal conv")

    def _time(self, module: torch.nn.Module, part: str) -> None:
        module.register_forward_pre_hook(lambda m, args: self._started.__setitem__(id(m), time.perf_counter()))
        module.register_forward_hook(
            lambda m, args, out: self.seconds.__setitem__(part, self.seconds[part] + time.perf_counter()
                                                          - self._started[id(m)]))

    def _wrap(self, function, part: str):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = function(*args, **kwargs)
            self.seconds[part] += time.perf_counter() - started
            return result
        return timed

    def take(self, total: float) -> dict[str, float]:
        """Exclusive seconds per part since the last take (a module's own time, its timed children
        subtracted; the rest of `total` as "other"), and start again."""
        s, self.seconds = dict(self.seconds), defaultdict(float)
        for parent, children in (("attention: rest", ("attention: q/k/v projection", "attention: o projection")),
                                 ("deltanet: rest", ("deltanet: in-projection", "deltanet: causal conv",
                                                     "deltanet: out-projection", "deltanet: delta rule"))):
            s[parent] = s.get(parent, 0.0) - sum(s.get(child, 0.0) for child in children)
        s["other (embedding, residual norms, Python)"] = total - sum(s.values())
        return s


def run(model: Qwen35ForCausalLM, prompt: int, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """(seconds per part of the prefill, of the decode steps), each with its "total"."""
    config = model.config
    backend = CpuAttentionBackend()
    block_size = 16
    blocks = math.ceil((prompt + steps) / block_size)
    kv = backend.allocate_kv_cache(kv_spec(config), blocks + 1, block_size)
    kv.initialize_blocks_through(blocks)
    tables = [list(range(1, blocks + 1))]
    states = StateCache(state_spec(config), 1)
    tokens = torch.randint(0, config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(1))

    def forward(ids: torch.Tensor, start: int) -> torch.Tensor:
        context = backend.build_context(kv, [SequenceSlice(tables, start, len(ids))])
        state = states.context([StateSequence(0, len(ids), start, 0)])
        return model(ids, torch.arange(start, start + len(ids)), context, torch.tensor([len(ids) - 1]), state)

    timer = PartTimer(model)
    started = time.perf_counter()
    logits = forward(tokens, 0)
    prefill = time.perf_counter() - started
    prefill_parts = {**timer.take(prefill), "total": prefill}
    started = time.perf_counter()
    for step in range(steps):
        logits = forward(logits[-1:].argmax(-1), prompt + step)
    decode = time.perf_counter() - started
    return prefill_parts, {**timer.take(decode), "total": decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--weights-dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = random_model(qwen35_0_8b_config())
    dtype = convert_linear_weights(model, args.weights_dtype)
    print(f"CPU: {describe_cpu()}; torch threads {torch.get_num_threads()}")
    print(f"Qwen3.5-0.8B shape, random weights: {model.num_parameters() / 1e6:.0f}M parameters, linear layers {dtype}")
    with torch.inference_mode():
        model(torch.tensor([1, 2, 3]), torch.arange(3))  # warm up (first-call allocations, kernels)
        prefill, decode = run(model, args.prompt, args.steps)
    for label, parts in ((f"prefill of {args.prompt} tokens", prefill), (f"{args.steps} decode steps", decode)):
        total = parts.pop("total")
        print(f"\n{label}: {total * 1e3:,.0f} ms" + (f" ({total / args.steps * 1e3:.1f} ms/step)"
                                                    if "decode" in label else ""))
        for part, seconds in sorted(parts.items(), key=lambda item: -item[1]):
            print(f"  {part:45s} {seconds * 1e3:9.1f} ms  {100 * seconds / total:5.1f}%")


if __name__ == "__main__":
    main()
