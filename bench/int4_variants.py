"""Which int4 KV scheme costs how much perplexity: an experiment on the attention math, not the engine.

The model runs each text window as one sequence without a cache, through a
contiguous attention context whose every attention call sees its keys and
values the way an int4 cache would give them back (fake quantization), under
several schemes:

- per-token groups of 32 / 16 channels (what `kv_cache_dtype="int4"` stores,
  with INT4_GROUP = 32 / 16);
- keys int8 per token, values int4 (the engine's "int8/int4");
- keys int4 per channel over 16-token blocks, values int4 per token (KIVI's
  layout; needs a block to be complete before its keys can be quantized, so
  the engine would have to hold the newest partial block in full precision);
- any of the above plus the newest 32 tokens kept in full precision, relative
  to each query, as a window of un-quantized recent tokens would.

Noise: at int4, a rounding-level difference in one layer's output (say, SDPA
against the explicit attention here, 5e-6 apart) moves some values across a
quantization step, and a 1,024-token window's perplexity can move by 1%. So
the default scores 8 windows, and figures from the engine
(bench/kv_quant_accuracy.py) and from this simulation agree only to about
that margin.

    .venv/bin/python bench/int4_variants.py [--windows 8] [--window 1024]
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

import kvserve.kv.cache.quant as quant
from kvserve.arith import round_up
from kvserve.kv.attention import ContiguousContext, attention_mask
from kvserve.model.loader import load_model
from kv_quant_accuracy import english_text
from workloads import save

FakeQuant = Callable[[torch.Tensor], torch.Tensor]  # [KVH, L, D] -> same, as stored and read back


def per_token(dtype: str, group: int | None = None) -> FakeQuant:
    """The engine's own codec; `group` overrides INT4_GROUP for the call (an experiment-only switch)."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        saved = quant.INT4_GROUP
        quant.INT4_GROUP = group or saved
        try:
            codec = quant.CODECS[dtype]
            return codec.decode(*codec.encode(x), torch.float32)
        finally:
            quant.INT4_GROUP = saved

    return apply


def per_channel_int4(block: int = 16) -> FakeQuant:
    """Asymmetric int4 per (channel, block of `block` tokens)."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        heads, length, dim = x.shape
        padded = round_up(length, block)
        blocks = F.pad(x, (0, 0, 0, padded - length)).view(heads, padded // block, block, dim)
        low = blocks.amin(dim=2, keepdim=True).half().float()
        scale = ((blocks.amax(dim=2, keepdim=True) - low) / 15).clamp_min(1e-6).half().float()
        q = ((blocks - low) / scale).round().clamp(0, 15)
        return (q * scale + low).view(heads, padded, dim)[:, :length]

    return apply


class FakeQuantContext(ContiguousContext):
    """The no-cache context, but keys/values older than `recent` tokens (per query) are read quantized."""

    def __init__(self, positions: torch.Tensor, layer_windows, k_quant: FakeQuant, v_quant: FakeQuant,
                 recent: int) -> None:
        super().__init__(positions, layer_windows)
        self.k_quant, self.v_quant, self.recent = k_quant, v_quant, recent

    def attend_sequence(self, q, k, v, scale, sliding_window):
        q_positions, recent = self.positions, self.recent
        num_heads, num_kv_heads = q.shape[0], k.shape[0]
        group = num_heads // num_kv_heads
        kq, vq = self.k_quant(k), self.v_quant(v)
        if recent:
            distance = q_positions[:, None] - torch.arange(k.shape[1])[None, :]
            fresh = distance < recent  # [T, L]: read in full precision
        mask = attention_mask(q_positions, k.shape[1], sliding_window)
        if mask is None:
            mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool)
        out = []
        for h in range(num_kv_heads):
            queries = q[h * group : (h + 1) * group]  # [G, T, D]
            scores = queries @ kq[h].T
            if recent:
                scores = torch.where(fresh, queries @ k[h].T, scores)
            probs = (scores * scale).masked_fill(~mask, float("-inf")).softmax(-1)
            result = probs @ vq[h]
            if recent:
                result = result + (probs * fresh) @ (v[h] - vq[h])  # recent rows read exactly
            out.append(result)
        return torch.cat(out).transpose(0, 1).reshape(q.shape[1], -1)


# (positions, layer windows) -> the attention context a window is scored with; None: the plain contiguous one
ContextFactory = Callable[[torch.Tensor, tuple], ContiguousContext]


def perplexity(model, windows: list[list[int]], make_context: ContextFactory | None = None) -> float:
    nll, count = 0.0, 0
    for window in windows:
        ids, positions = torch.tensor(window), torch.arange(len(window))
        context = None if make_context is None else make_context(positions, model.layer_windows)
        logits = model(ids, positions, context, torch.arange(len(window) - 1))
        logprobs = logits.float().log_softmax(-1)
        nll -= logprobs.gather(1, ids[1:, None]).sum().item()
        count += len(window) - 1
    return math.exp(nll / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--recent", type=int, default=32, help="full-precision window, tokens")
    args = parser.parse_args()
    loaded = load_model()
    tokens = loaded.require_tokenizer().encode(english_text())
    windows = [tokens[i * args.window : (i + 1) * args.window] for i in range(args.windows)]
    exact = lambda x: x  # noqa: E731
    schemes = {
        "float32": (exact, exact, 0),
        "int4 per token, groups of 32": (per_token("int4", 32), per_token("int4", 32), 0),
        "int4 per token, groups of 16": (per_token("int4", 16), per_token("int4", 16), 0),
        "K int8 / V int4 (g16)": (per_token("int8"), per_token("int4", 16), 0),
        "K int4 per channel / V int4 (g16)": (per_channel_int4(), per_token("int4", 16), 0),
        f"int4 g32 + newest {args.recent} fp32": (per_token("int4", 32), per_token("int4", 32), args.recent),
        f"int4 g16 + newest {args.recent} fp32": (per_token("int4", 16), per_token("int4", 16), args.recent),
        f"K int4 per channel / V g16 + newest {args.recent} fp32": (per_channel_int4(), per_token("int4", 16),
                                                                    args.recent),
    }
    rows = []
    for name, (k_quant, v_quant, recent) in schemes.items():
        make_context = None if name == "float32" else functools.partial(
            FakeQuantContext, k_quant=k_quant, v_quant=v_quant, recent=recent)
        ppl = perplexity(loaded.model, windows, make_context)
        change = 100 * (ppl / rows[0]["perplexity"] - 1) if rows else 0.0
        rows.append({"scheme": name, "perplexity": ppl, "change_pct": change})
        print(f"{name:<48} ppl {ppl:.4f} ({change:+.2f}%)", flush=True)
    print(f"saved {save('int4_variants', {'tokens': args.windows * args.window, 'rows': rows})}")


if __name__ == "__main__":
    main()
