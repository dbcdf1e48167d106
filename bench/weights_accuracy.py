"""What each weights dtype costs in accuracy, on the same text and windows as bench/kv_quant_accuracy.py.

For each `--weights-dtype` (float32 first, the reference; the KV cache stays
float32): perplexity and its change, mean KL(float32 || dtype) of the
next-token distributions, top-1 agreement, and greedy agreement length on the
chat prompts. The embedded model is a Q4_1 GGUF (Q8_0 embedding / head): int4
and int8 hold the file's own codes (its 4-bit groups, its 8-bit head) and run
int8 activations per group of 32; bfloat16 runs bf16 activations.

    .venv/bin/python bench/weights_accuracy.py [--dtypes bfloat16 int8 int4] [--windows 8] [--window 1024]
                                               [--model gemma3]

`--model gemma3` scores Gemma 3 270M (a Q4_K_M file: int4 re-quantizes its
K-quant weights); a model without a chat template skips the greedy chats.
"""

from __future__ import annotations

import argparse
import math

from kvserve import LLM
from kvserve.cpu_features import describe_cpu
from kv_quant_accuracy import agreement_length, english_text, greedy_chats, score
from workloads import save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "int8", "int4"])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--model", default=None, help="GGUF / HF directory, or gemma3 (default: the embedded model)")
    args = parser.parse_args()
    if args.model == "gemma3":
        from kvserve.model.loader import gemma3_270m_path

        args.model = str(gemma3_270m_path())
    print(f"CPU: {describe_cpu()}", flush=True)

    def make(dtype: str) -> LLM:
        return LLM(model=args.model, weights_dtype=dtype, kv_cache_dtype="float32", kv_cache_memory="1GiB",
                   max_num_batched_tokens=args.chunk)

    rows, reference, reference_chats = [], None, None
    for dtype in ["float32"] + [d for d in args.dtypes if d != "float32"]:
        llm = make(dtype)
        if reference is None:
            tokens = llm.get_tokenizer().encode(english_text())
            windows = [tokens[i * args.window : (i + 1) * args.window] for i in range(args.windows)]
        nll, logprobs = score(llm, windows)
        chats = greedy_chats(llm) if llm.get_tokenizer().chat_template else []
        if reference is None:
            reference, reference_chats = logprobs, chats
        kl = (reference.exp() * (reference - logprobs)).sum(-1)
        top1 = (reference.argmax(-1) == logprobs.argmax(-1)).float().mean().item()
        lengths = [agreement_length(r, c) for r, c in zip(reference_chats, chats)]
        row = {"weights_dtype": dtype, "weight_bytes": llm.engine.loaded.weight_bytes, "perplexity": math.exp(nll),
               "mean_kl": kl.mean().item(), "top1_agreement": top1, "greedy_agreement": lengths}
        row["perplexity_change_pct"] = 100 * (row["perplexity"] / rows[0]["perplexity"] - 1) if rows else 0.0
        rows.append(row)
        held = sum(row["weight_bytes"].values()) / 2**20
        print(f"{dtype:>9}: weights held {held:.0f} MiB  ppl {row['perplexity']:.4f} "
              f"({row['perplexity_change_pct']:+.3f}%)  KL {row['mean_kl']:.2e}  top-1 {100 * top1:.2f}%  "
              f"greedy agreement {lengths} of 64", flush=True)
        del llm

    path = save("weights_accuracy", {"cpu": describe_cpu(), "tokens": args.windows * args.window, "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
