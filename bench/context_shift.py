"""What a context shift costs in accuracy: continuing past the context with shifted K/V vs recomputing.

`--context-overflow shift` keeps the first --keep tokens and drops half of the
rest when a sequence reaches the context; the kept keys are re-rotated to
their new positions (the model's `shift_key_positions`, what the engine's
runner applies to the paged cache; tests/engine/test_context_shift.py checks
the paged moves equal this math exactly on a one-layer model). Their K/V were
computed while the dropped tokens were still visible, so in every layer
above the first they differ from a fresh computation of the shorter context.

This scores real text (the Python Language Reference prose of
bench/kv_quant_accuracy.py) teacher-forced past a small context, three ways,
on the same predicted tokens:
- shift: one pass, K/V kept across shifts and re-rotated (what the engine does);
- recompute: every token predicted by a fresh forward over exactly the tokens
  the shifted cache holds (the truncated context, no stale K/V);
- full: the whole text in one forward (no limit; what a longer context buys).
It prints perplexity, mean KL(recompute || shift) and top-1 agreement.

    .venv/bin/python bench/context_shift.py [--context 256] [--keep 4] [--tokens 768]
"""

from __future__ import annotations

import argparse
import math

import torch

from kvserve.kv.attention import AttentionContext, attend
from kvserve.model.loader import load_model
from kv_quant_accuracy import english_text
from workloads import save


class ShiftingContext(AttentionContext):
    """A contiguous K/V cache per layer that can drop tokens and re-rotate the kept keys (one sequence)."""

    def __init__(self, model) -> None:
        self.model = model
        self.keys: list[torch.Tensor | None] = [None] * len(model.layers)
        self.values: list[torch.Tensor | None] = [None] * len(model.layers)
        self.positions = torch.arange(0)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        cached_k, cached_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k if cached_k is None else torch.cat([cached_k, k])
        self.values[layer] = v if cached_v is None else torch.cat([cached_v, v])
        keys, values = self.keys[layer].transpose(0, 1), self.values[layer].transpose(0, 1)
        return attend(q.transpose(0, 1), keys, values, self.positions, scale)

    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[0]

    def shift(self, keep: int, drop: int) -> None:
        for layer in range(len(self.keys)):
            moved = self.model.shift_key_positions(layer, self.keys[layer][keep + drop :], -drop)
            self.keys[layer] = torch.cat([self.keys[layer][:keep], moved])
            self.values[layer] = torch.cat([self.values[layer][:keep], self.values[layer][keep + drop :]])


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=256, help="the context limit the text runs past")
    parser.add_argument("--keep", type=int, default=4, help="tokens never dropped (--keep-tokens)")
    parser.add_argument("--tokens", type=int, default=768, help="text tokens scored (from position --context on)")
    args = parser.parse_args()

    loaded = load_model(None, weights_dtype="float32")  # exact weights: only the shift differs
    model, tokenizer = loaded.model, loaded.require_tokenizer()
    text = tokenizer.encode(english_text())[: args.context + args.tokens]
    print(f"model: {loaded.source} (float32 weights); text: {len(text)} tokens; context {args.context}, "
          f"keep {args.keep}, drop half of the rest per shift", flush=True)

    # Shift: prefill all but the last of the first `context` tokens, then feed one token at a time; each
    # fed token's logits score the next. Before a token would lie past the context, shift as the engine does.
    cache = ShiftingContext(model)
    cache.positions = torch.arange(args.context - 1)
    model(torch.tensor(text[: args.context - 1]), cache.positions, cache)
    held = list(text[: args.context - 1])  # the tokens the cache stands for, in order
    shift_rows, recompute_rows, shifts = [], [], 0
    for t in range(args.context, len(text)):
        if cache.length() + 1 > args.context:
            drop = (cache.length() - args.keep) // 2  # the engine's (num_tokens - 1 - keep) // 2
            cache.shift(args.keep, drop)
            del held[args.keep : args.keep + drop]
            shifts += 1
        cache.positions = torch.tensor([cache.length()])
        shifted = model(torch.tensor([text[t - 1]]), cache.positions, cache)
        held.append(text[t - 1])
        recomputed = model(torch.tensor(held), torch.arange(len(held)), logits_indices=torch.tensor([len(held) - 1]))
        shift_rows.append(shifted.float().log_softmax(-1))
        recompute_rows.append(recomputed.float().log_softmax(-1))
        if (t - args.context) % 128 == 127:
            print(f"  {t - args.context + 1} tokens scored, {shifts} shifts", flush=True)
    targets = text[args.context :]

    target = torch.tensor(targets)[:, None]
    shift_lp, recompute_lp = torch.cat(shift_rows), torch.cat(recompute_rows)
    full_lp = model(torch.tensor(text), torch.arange(len(text)))[args.context - 1 : -1].float().log_softmax(-1)
    ppl = {name: math.exp(-lp.gather(1, target).mean().item())
           for name, lp in (("shift", shift_lp), ("recompute", recompute_lp), ("full", full_lp))}
    kl = (recompute_lp.exp() * (recompute_lp - shift_lp)).sum(-1).mean().item()
    top1 = (recompute_lp.argmax(-1) == shift_lp.argmax(-1)).float().mean().item()
    print(f"perplexity over {len(targets)} tokens past the context: shift {ppl['shift']:.3f}, recompute of the "
          f"truncated context {ppl['recompute']:.3f} ({100 * (ppl['shift'] / ppl['recompute'] - 1):+.2f}%), "
          f"no limit {ppl['full']:.3f}; KL(recompute || shift) {kl:.4f}, top-1 agreement {100 * top1:.1f}%; "
          f"{shifts} shifts")
    save("context_shift", {"context": args.context, "keep": args.keep, "tokens": len(targets), "shifts": shifts,
                           "perplexity": ppl, "mean_kl": kl, "top1_agreement": top1})


if __name__ == "__main__":
    main()
