"""What each KV-cache dtype costs in accuracy, on real English text, through the public API.

Text: the prose paragraphs of the Python Language Reference that ship with
every CPython as `pydoc_data.topics` (PSF License; code samples and grammar
lines dropped), cut into windows of --window tokens.

For each cache dtype, each window is run once with `prompt_logprobs` and
prefill chunks of --chunk tokens, so every chunk attends over keys and values
read back from the (quantized) cache:
- perplexity of the text, and its change against the float32 cache;
- mean KL(float32 || dtype) of the next-token distributions over the full
  vocabulary, and how often the top-1 token agrees with float32's;
- greedy agreement length: on a few chat prompts, how many of 64 greedy
  tokens match the float32 cache's before the first difference.

Weights in float32 by default (--weights-dtype), so that the cache is the only
approximation; --model gemma3-270m runs Gemma 3 270M (installed with the dev
extras), anything else is a path or name `LLM` takes.

    .venv/bin/python bench/kv_quant_accuracy.py [--dtypes int8 int4 ...] [--windows 2] [--window 2048]
        [--model gemma3-270m] [--skip-chats]
"""

from __future__ import annotations

import argparse
import math

import torch

import kvserve.engine.sample.acceptance as runner_module
from kvserve import LLM, SamplingParams
from workloads import save

DTYPES = ["float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int8/int4"]
CHAT_PROMPTS = [
    "Explain why the sky is blue in three sentences.",
    "Write a short poem about a lighthouse keeper.",
    "What are the main differences between a list and a tuple in Python?",
    "Give me a recipe for a simple tomato soup.",
]


def english_text() -> str:
    """Prose paragraphs of the Python reference (no code, no grammar), in a fixed order."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in topics[name].split("\n\n"):
            lines = block.splitlines()
            if not lines or any(line.startswith((" ", "\t", "*", "=", "-", ">>>")) for line in lines):
                continue
            text = " ".join(line.strip() for line in lines)
            if len(text.split()) >= 20:
                paragraphs.append(text)
    return "\n\n".join(paragraphs)


class LogitsRecorder:
    """Collects the full next-token logits the runner scores prompt tokens with (for KL / top-1)."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self._original = runner_module.token_logprobs

    def __enter__(self) -> "LogitsRecorder":
        def recording(logits, targets, top_k):
            self.rows.append(logits.float().log_softmax(-1))
            return self._original(logits, targets, top_k)

        runner_module.token_logprobs = recording
        return self

    def __exit__(self, *exc) -> None:
        runner_module.token_logprobs = self._original

    def take(self) -> torch.Tensor:
        rows, self.rows = self.rows, []
        return torch.cat(rows)


def score(llm: LLM, windows: list[list[int]]) -> tuple[float, torch.Tensor]:
    """(mean negative log-likelihood per token, log-probabilities [tokens, vocab])."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    nll, count, logprobs = 0.0, 0, []
    with LogitsRecorder() as recorder:
        for window in windows:  # one at a time: the recorder's rows stay in order
            output = llm.generate([window], params, use_tqdm=False)[0]
            values = [entry.logprob for entry in output.prompt_logprobs[1:]]
            nll -= sum(values)
            count += len(values)
            logprobs.append(recorder.take())
    return nll / count, torch.cat(logprobs)


def divergence(reference: torch.Tensor, logprobs: torch.Tensor, rows: int = 256) -> tuple[torch.Tensor, float]:
    """KL(float32 || dtype) per position and top-1 agreement, a few rows at a time (a 262k vocabulary's
    temporaries over thousands of positions would take gigabytes)."""
    kl, same = [], 0
    for start in range(0, len(reference), rows):
        ref, lp = reference[start : start + rows], logprobs[start : start + rows]
        kl.append((ref.exp() * (ref - lp)).sum(-1))
        same += int((ref.argmax(-1) == lp.argmax(-1)).sum())
    return torch.cat(kl), same / len(reference)


def greedy_chats(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def agreement_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def model_source(name: str | None) -> str | None:
    if name == "gemma3-270m":
        from kvserve.model.loader import gemma3_270m_path

        return str(gemma3_270m_path())
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=DTYPES)
    parser.add_argument("--windows", type=int, default=2, help="text windows scored (int4 figures move ~1%% with few)")
    parser.add_argument("--window", type=int, default=2048, help="tokens per window")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--model", default=None, help="gemma3-270m, or what LLM(model=) takes (default: SmolLM2)")
    parser.add_argument("--weights-dtype", default="float32")
    parser.add_argument("--skip-chats", action="store_true", help="no greedy agreement (perplexity, KL, top-1 only)")
    args = parser.parse_args()
    dtypes = ["float32"] + [d for d in args.dtypes if d != "float32"]
    model = model_source(args.model)

    def make_llm(dtype: str) -> LLM:
        return LLM(model, kv_cache_dtype=dtype, kv_cache_memory="1GiB", max_num_batched_tokens=args.chunk,
                   weights_dtype=args.weights_dtype, max_model_len=max(args.window + 64, 4096))

    reference_llm = make_llm("float32")
    tokens = reference_llm.get_tokenizer().encode(english_text())
    needed = args.windows * args.window
    if len(tokens) < needed:
        raise SystemExit(f"only {len(tokens)} tokens of text; lower --windows or --window")
    windows = [tokens[i * args.window : (i + 1) * args.window] for i in range(args.windows)]
    print(f"model: {args.model or 'SmolLM2-135M-Instruct'}, weights {args.weights_dtype}; text: {needed} tokens of "
          f"Python Language Reference prose in {args.windows} windows of {args.window}; prefill chunks of {args.chunk}",
          flush=True)

    rows, reference, reference_chats = [], None, None
    for dtype in dtypes:
        llm = reference_llm if dtype == "float32" else make_llm(dtype)
        nll, logprobs = score(llm, windows)
        chats = [] if args.skip_chats else greedy_chats(llm)
        if dtype == "float32":
            reference, reference_chats = logprobs, chats
        kl, top1 = divergence(reference, logprobs)
        lengths = [agreement_length(r, c) for r, c in zip(reference_chats, chats)]
        row = {
            "dtype": dtype, "bytes_per_token": llm.engine.kv_spec.bytes_per_token, "perplexity": math.exp(nll),
            "mean_kl": kl.mean().item(), "top1_agreement": top1, "greedy_agreement": lengths,
        }
        row["perplexity_change_pct"] = 100 * (row["perplexity"] / rows[0]["perplexity"] - 1) if rows else 0.0
        rows.append(row)
        print(f"{dtype:>9}: {row['bytes_per_token']:>6,} B/token  ppl {row['perplexity']:.4f} "
              f"({row['perplexity_change_pct']:+.3f}%)  KL {row['mean_kl']:.2e}  top-1 {100 * top1:.2f}%  "
              f"greedy agreement {lengths} of 64", flush=True)
        if llm is not reference_llm:
            del llm

    print("\n| dtype | bytes/token | perplexity | vs float32 | mean KL | top-1 agree | greedy agreement (of 64) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['bytes_per_token']:,} | {r['perplexity']:.4f} | {r['perplexity_change_pct']:+.3f}% "
              f"| {r['mean_kl']:.2e} | {100 * r['top1_agreement']:.2f}% | {', '.join(map(str, r['greedy_agreement']))} |")
    path = save("kv_quant_accuracy", {"model": args.model or "SmolLM2-135M-Instruct", "weights_dtype": args.weights_dtype,
                                      "tokens": needed, "window": args.window, "chunk": args.chunk, "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
