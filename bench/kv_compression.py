"""What question-agnostic KV compression costs: a continuation scored after a compressed prefix of real text.

An experiment on the attention math, not the engine (bench/kv_compression_engine.py runs the engine). For each
text window (Python Language Reference prose, as bench/kv_quant_accuracy.py, repeated paragraphs dropped): one contiguous forward of a
--prefix-token prompt captures every layer's K/V and its last --query-window queries; each method compresses
each layer per KV head (kvserve.kv.compression) at each ratio; then the next --continuation tokens run as one
forward whose attention sees the compressed prefix plus their own tokens (CompressedPrefixContext). Scored
against the same continuation over the uncompressed prefix ("none"): perplexity, mean KL(none || method) over
the vocabulary, top-1 agreement. "none" itself is checked against one forward over prefix + continuation.

Layers with a sliding window (Gemma 3's local layers) are not compressed: their cache holds only the window.

--engine: the engine's setting (bench/kv_chunked.py): canonical --chunk-token chunks, each compressed from its own
K/V when the prompt goes on >= 64 tokens past it, kept counts rounded to whole 16-token blocks, chunk 0 keeping the
sinks, the rest exact; --chunk-methods name the ways of scoring a chunk (key-only; chunk-local Expected / observed
attention over the chunk's own last 64 queries; a protected recent tail; AdaKV budgets; larger chunks). The scored
tokens follow the prompt (generated after it: --prefix 2112 compresses 4 chunks and keeps 64 exact), or, with
--scored-in-prompt, are part of it (the engine's prompt logprobs: every chunk of a 2,048-token prefix compressed).

--passkey N: N retrievals (a 5-digit number hidden at spread depths in ~--passkey-context tokens of filler);
the filler is the compressed prefix, the question follows it (as a request reusing a cached document would),
greedy answer; fraction retrieved per method and ratio, at each --passkey-context.

    .venv/bin/python bench/kv_compression.py [--windows 2] [--model gemma3-270m] [--passkey 5]

Figures, --engine (2026-11-28, AMD EPYC, 2 cores shared with other jobs: quality figures only; float32 weights;
perplexity change vs none, mean KL, top-1; chunk 512 unless @N; "+r64": the chunk's newest 64 kept, "+third": the
newest third of its budget; "_ada": AdaKV budgets; ea/snap_local: the chunk's own last 64 queries):

  SmolLM2, --scored-in-prompt --windows 2 (every chunk of the 2,048 prefix compressed; none 17.6243):
    2x: knorm +4.64% .059 89.8 | knorm+r64 +3.47% .047 90.6 | knorm+third +3.90% | streaming +2.90% .029 90.8 |
        keydiff +7.69% | knormv +2.84% .082 85.7 | ea_local +2.52% .027 92.4 | snap_local_ada +2.92% .029 93.7 |
        snap_local@2048 +1.83% .020 95.5 | ea_local@2048 +0.89% .017 95.1 | knorm@2048 +5.84%
    4x: knorm +11.40% .112 | knorm+r64 +8.14% .082 | knorm+third +7.22% | streaming +8.92% | ea_local +8.00% |
        snap_local@2048 +5.26% | ea_local@2048 +4.58% .049 89.6 | knorm@2048 +13.01%
  SmolLM2, --prefix 2112 --windows 1 (4 chunks compressed, the last 64 prompt tokens exact; none 10.5422):
    2x: knorm +2.33% .017 94.5 | streaming +1.65% .013 95.3 | knorm+third +3.04% | knormv +1.23% .043 88.6 |
        snap_local_ada +2.20% .012 96.1 | ea_local_ada +2.69% | keydiff +3.95% | knorm@2048 +2.57%
    4x: knorm +3.48% .029 93.3 | streaming +4.53% | knorm+third +4.90% | snap_local_ada +4.98% | knorm@2048 +3.12%
  Gemma 3 270M, --scored-in-prompt --windows 1 (global layers only; none 12.4557; one KV head, so _ada = plain):
    2x: knorm +2.80% .040 94.1 | streaming +0.25% .014 95.7 | knorm+third +2.46% | knormv +1.53% |
        ea_local +1.13% .012 96.1 | snap_local +2.06% .010 96.9 | snap_local@2048 -0.07% .008 98.4 | knorm@2048 +4.39%
    4x: knorm +2.90% .071 91.8 | streaming +4.70% | knorm+third +2.10% | ea_local +2.33% | snap_local@2048 +1.93%
    knorm+r64 (a second run, same window): 2x +2.70% .044 92.5, 4x +1.93% .058 91.0 (SmolLM2 with the prompt's
    last 64 exact, same way: 2x +2.89% .015 95.7, 4x +4.77% .025 94.5)
  SmolLM2 passkey, --engine --windows 0 --ratios 2 (--passkey 2 --passkey-context 1024 2048; --passkey 1 4096),
  the question in the prompt (the document's last >= 64 tokens exact); uncompressed retrieved every one:
    1024: knorm 2/2, knorm+r64 2/2, streaming 1/2, snap_local_ada 1/2, ea_local_ada 1/2
    2048: knorm 2/2, knorm+r64 1/2, streaming 1/2, snap_local_ada 1/2, ea_local_ada 1/2
    4096: knorm 1/1, streaming 1/1, knorm+r64 0/1, snap_local_ada 0/1, ea_local_ada 0/1
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from kvserve.kv.compression import (METHODS, CompressedPrefixContext, CompressionSpec, PromptCapture,
                                    compress_layer)
from kvserve.model.loader import load_model
from kv_chunked import METHODS as CHUNK_METHODS, FullCapture, compressed_chunks
from kv_quant_accuracy import english_text, model_source
from workloads import save

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def unique_text() -> str:
    """english_text() with each paragraph once: the Python reference repeats some under several topics, and a
    continuation that copies a passage of its own prefix measures recall of that passage, not compression."""
    return "\n\n".join(dict.fromkeys(english_text().split("\n\n")))


def compressed_prefixes(capture: PromptCapture, spec, layer_windows, total_prompt: int) -> list:
    """`spec`: a CompressionSpec (the whole prefix at once) or (spec, ChunkMethod) (the engine's chunks, for a
    prompt of `total_prompt` tokens that starts with the prefix)."""
    if isinstance(spec, tuple):
        return compressed_chunks(capture, spec[0], spec[1], layer_windows, total_prompt)
    keep_all = CompressionSpec("streaming", 1)
    return [compress_layer(kv, keep_all if window is not None else spec)
            for kv, window in zip(capture.layers(), layer_windows)]


def capture_prompt(model, ids: torch.Tensor, query_window: int) -> PromptCapture:
    if query_window <= 0:  # every query (the chunk-local methods read each chunk's last ones)
        capture = FullCapture(torch.arange(len(ids)), model.layer_windows)
    else:
        capture = PromptCapture(torch.arange(len(ids)), model.layer_windows, query_window)
    model(ids, torch.arange(len(ids)), capture, torch.tensor([len(ids) - 1]))
    return capture


def continuation_logprobs(model, prefixes, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Log-probabilities `[N - 1, vocab]` of ids[1:] after the compressed prefix (ids at start..start+N-1)."""
    positions = torch.arange(start, start + len(ids))
    context = CompressedPrefixContext(positions, prefixes, model.layer_windows)
    return model(ids, positions, context, torch.arange(len(ids) - 1)).float().log_softmax(-1)


def specs(args) -> list[tuple[str, object]]:
    found = [("none", CompressionSpec("streaming", 1))]
    for ratio in args.ratios:
        if args.engine:
            spec = CompressionSpec("knorm", ratio, args.sinks, args.recent, args.chunk)
            found += [(f"{m}:{ratio:g}", (spec, CHUNK_METHODS[m])) for m in args.chunk_methods]
        else:
            found += [(f"{m}:{ratio:g}", CompressionSpec(m, ratio, args.sinks, args.recent)) for m in args.methods]
    return found


def score_windows(model, windows: list[list[int]], args) -> dict[str, dict]:
    totals = {name: {"nll": 0.0, "kl": 0.0, "top1": 0, "count": 0} for name, _ in specs(args)}
    for index, window in enumerate(windows):
        ids = torch.tensor(window)
        prefix, rest = ids[: args.prefix], ids[args.prefix :]
        started = time.perf_counter()
        whole = model(ids, torch.arange(len(ids)), None, torch.arange(args.prefix, len(ids) - 1)).float()
        capture = capture_prompt(model, prefix, 0 if args.engine else args.query_window)
        reference = None
        for name, spec in specs(args):
            total = len(ids) if args.scored_in_prompt else args.prefix
            prefixes = compressed_prefixes(capture, spec, model.layer_windows, total)
            logprobs = continuation_logprobs(model, prefixes, rest, args.prefix)
            if reference is None:
                reference = logprobs
                drift = (logprobs - whole.log_softmax(-1)).abs().max().item()
            row = totals[name]
            row["nll"] -= logprobs.gather(1, rest[1:, None]).sum().item()
            row["kl"] += (reference.exp() * (reference - logprobs)).sum().item()
            row["top1"] += int((reference.argmax(-1) == logprobs.argmax(-1)).sum())
            row["count"] += len(rest) - 1
        print(f"window {index}: {time.perf_counter() - started:.1f}s; 'none' vs one whole forward: max |log-prob "
              f"difference| {drift:.2e}", flush=True)
    return totals


def passkey_prompts(tokenizer, count: int, context: int) -> list[tuple[list[int], list[int], str]]:
    """(document ids, question ids, key): the key hidden at depths spread from 10% to 90%."""
    gen = torch.Generator().manual_seed(0)
    filler_tokens = len(tokenizer.encode(FILLER, add_special_tokens=False))
    repeats = max(1, context // filler_tokens)
    prompts = []
    for i in range(count):
        key = str(int(torch.randint(10000, 100000, (1,), generator=gen)))
        depth = int(repeats * (0.1 + 0.8 * i / max(1, count - 1)))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        document = ("There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                    + FILLER * depth + needle + FILLER * (repeats - depth))
        question = "What is the pass key? The pass key is"
        prompts.append((tokenizer.encode(document), tokenizer.encode(question, add_special_tokens=False), key))
    return prompts


def greedy_answer(model, prefixes, question: list[int], start: int, steps: int = 8) -> list[int]:
    ids = list(question)
    for _ in range(steps):  # the whole answer so far each step: a few tokens, no cache of its own needed
        positions = torch.arange(start, start + len(ids))
        context = CompressedPrefixContext(positions, prefixes, model.layer_windows)
        logits = model(torch.tensor(ids), positions, context, torch.tensor([len(ids) - 1]))
        ids.append(int(logits[0].argmax()))
    return ids[len(question) :]


def passkey(model, tokenizer, args, context: int) -> dict[str, float]:
    found = {name: 0 for name, _ in specs(args)}
    prompts = passkey_prompts(tokenizer, args.passkey, context)
    for document, question, key in prompts:
        capture = capture_prompt(model, torch.tensor(document), 0 if args.engine else args.query_window)
        total = len(document) + len(question)  # the engine compresses chunks the whole prompt goes on past
        for name, spec in specs(args):
            prefixes = compressed_prefixes(capture, spec, model.layer_windows, total)
            answer = tokenizer.decode(greedy_answer(model, prefixes, question, len(document)))
            found[name] += key in answer
            if name == "none":
                print(f"passkey {key} in {len(document)} tokens: uncompressed answers {answer!r}", flush=True)
    return {name: hits / len(prompts) for name, hits in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="gemma3-270m, or a path load_model takes (default: SmolLM2)")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--ratios", type=float, nargs="+", default=[2, 4])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--recent", type=int, default=64, help="last prompt tokens always kept")
    parser.add_argument("--query-window", type=int, default=256, help="last queries Expected Attention fits")
    parser.add_argument("--weights-dtype", default="float32")
    parser.add_argument("--passkey", type=int, default=0, help="passkey retrievals (0: none)")
    parser.add_argument("--passkey-context", type=int, nargs="+", default=[1536])
    parser.add_argument("--engine", action="store_true", help="the engine's setting: canonical chunks, each "
                        "compressed from its own K/V (bench/kv_chunked.py), --chunk-methods instead of --methods")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--scored-in-prompt", action="store_true", help="--engine: the scored tokens are part of "
                        "the prompt (as the engine's prompt logprobs score them): every chunk of the prefix is "
                        "compressed; default: they follow the prompt (generated), whose last >= 64 tokens stay exact")
    parser.add_argument("--chunk-methods", nargs="+", default=list(CHUNK_METHODS))
    args = parser.parse_args()
    loaded = load_model(model_source(args.model), weights_dtype=args.weights_dtype)
    model, tokenizer = loaded.model, loaded.require_tokenizer()
    torch.set_grad_enabled(False)
    length = args.prefix + args.continuation
    tokens = tokenizer.encode(unique_text())
    if len(tokens) < args.windows * length:  # --windows 0: the passkey alone
        raise SystemExit(f"only {len(tokens)} tokens of text; lower --windows")
    windows = [tokens[i * length : (i + 1) * length] for i in range(args.windows)]
    name = args.model or "SmolLM2-135M-Instruct"
    print(f"model: {name}, weights {args.weights_dtype}; {args.windows} windows of {args.prefix} prefix + "
          f"{args.continuation} scored tokens (Python Language Reference prose); sinks {args.sinks}, window "
          f"{args.recent}, Expected Attention over the last {args.query_window} queries", flush=True)
    totals = score_windows(model, windows, args) if windows else {}
    retrieved = {}
    for context in args.passkey_context if args.passkey else []:
        for key, value in passkey(model, tokenizer, args, context).items():
            retrieved.setdefault(key, {})[context] = value
        print(f"passkey at {context}: " + ", ".join(f"{k} {100 * v[context]:.0f}%" for k, v in retrieved.items()),
              flush=True)
    rows, empty = [], {"nll": math.nan, "count": 1, "kl": math.nan, "top1": math.nan}
    base = math.exp(totals.get("none", empty)["nll"] / totals.get("none", empty)["count"])
    for key, _ in specs(args):
        row = totals.get(key, empty)
        ppl = math.exp(row["nll"] / row["count"])
        rows.append({"method": key, "perplexity": ppl, "change_pct": 100 * (ppl / base - 1),
                     "mean_kl": row["kl"] / row["count"], "top1": row["top1"] / row["count"],
                     "passkey": retrieved.get(key)})
    contexts = args.passkey_context if retrieved else []
    print("\n| method:ratio | perplexity | vs none | mean KL | top-1 agree |"
          + "".join(f" passkey {c} |" for c in contexts))
    print("|---|---|---|---|---|" + "---|" * len(contexts))
    for r in rows:
        line = (f"| {r['method']} | {r['perplexity']:.4f} | {r['change_pct']:+.2f}% | {r['mean_kl']:.4f} | "
                f"{100 * r['top1']:.1f}% |")
        print(line + "".join(f" {100 * r['passkey'][c]:.0f}% |" for c in contexts))
    payload = {"model": name, "args": vars(args), "rows": rows}
    tag = ('_' + args.model if args.model else '') + ('_chunked' if args.engine else '')
    print(f"saved {save('kv_compression' + tag, payload)}")


if __name__ == "__main__":
    main()
